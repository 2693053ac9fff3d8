"""jaxspec.load / jaxspec.save: refusals of bad checkpoints and options (each naming the value and
what is valid), save -> load round trips that reproduce outputs exactly, the built-in demo models,
and MTP weights through load."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

import jaxspec
from jaxspec.compile import count_compiles
from jaxspec.config import ConfigError
from jaxspec.tokenizer import ByteTokenizer
from jaxspec.weights import CheckpointError, read_checkpoint_tensors, write_safetensors
from tests.demo_models import NEW_TOKENS, SETTINGS, demo_model, prompts

# Same settings as tests/models' jax_model, so a full run reuses the parity suite's executables.
HF_SETTINGS = dict(dtype="float32", kernels="xla", max_model_len=64, max_num_seqs=8, prefill_chunk=8, page_size=4)
DEMO_FAMILIES = ("qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe", "qwen3_next")


def assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# ---- bad checkpoints ---------------------------------------------------------------------------

def edit_config(d, change):
    cfg = json.loads((d / "config.json").read_text())
    change(cfg)
    (d / "config.json").write_text(json.dumps(cfg))


def edit_tensors(d, change):
    tensors = {k: np.array(v) for k, v in read_checkpoint_tensors(d).items()}
    change(tensors)
    write_safetensors(tensors, d / "model.safetensors")


def damage_file(d, damage):
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(damage(data))


DAMAGE = {
    "no config.json": (lambda d: (d / "config.json").unlink(), ConfigError, "has no config.json"),
    "garbled config.json": (lambda d: (d / "config.json").write_text('{"model_type": "qwen3",'),
                            ConfigError, r"config.json is not valid JSON"),
    "config.json not an object": (lambda d: (d / "config.json").write_text("[1, 2]"),
                                  ConfigError, "config must be a dict parsed from config.json, got list"),
    "unknown model_type": (lambda d: edit_config(d, lambda c: c.update(model_type="llama")),
                           ConfigError, r"model_type='llama' is not supported; valid: qwen3, qwen3_5"),
    "missing field": (lambda d: edit_config(d, lambda c: c.pop("hidden_size")),
                      ConfigError, "missing required field 'hidden_size'"),
    "bad field": (lambda d: edit_config(d, lambda c: c.update(num_attention_heads=0)),
                  ConfigError, "num_attention_heads=0 must be a positive integer"),
    "missing tensor": (lambda d: edit_tensors(d, lambda t: t.pop("model.layers.1.mlp.up_proj.weight")),
                       CheckpointError, r"missing tensor 'model.layers.1.mlp.up_proj.weight' \(expected shape"),
    "shape mismatch": (lambda d: edit_tensors(d, lambda t: t.update({"model.norm.weight": np.ones(47, np.float32)})),
                       CheckpointError, r"'model.norm.weight' has shape \[47\], expected \[48\]"),
    "truncated safetensors": (lambda d: damage_file(d, lambda b: b[:-100]), CheckpointError,
                              r"model.safetensors: corrupt or truncated safetensors file .*not fully covered"),
    "corrupt safetensors": (lambda d: damage_file(d, lambda b: b"\xff" * 64), CheckpointError,
                            r"model.safetensors: corrupt or truncated safetensors file"),
    "no safetensors": (lambda d: (d / "model.safetensors").unlink(), CheckpointError, "no safetensors files"),
}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_bad_checkpoint_is_refused(case, hf_checkpoint, tmp_path):
    good = hf_checkpoint("qwen3")
    bad = shutil.copytree(good, tmp_path / "ckpt")
    damage, error, message = DAMAGE[case]
    damage(bad)
    with pytest.raises(error, match=message):
        jaxspec.load(bad, **HF_SETTINGS)
    assert jaxspec.load(good, **HF_SETTINGS).config.model_type == "qwen3"


BAD_OPTIONS = {
    "dtype": (dict(dtype="fp32"), r"dtype='fp32' is not valid; choose one of 'auto', 'bfloat16', 'float32'"),
    "dtype float16": (dict(dtype="float16"), r"dtype='float16' is not valid"),
    "kernels": (dict(kernels="cuda"), r"kernels='cuda' is not valid; choose one of \('auto', 'xla', 'pallas'\)"),
    "max_model_len": (dict(max_model_len=0), "max_model_len=0 must be a positive integer"),
    "max_num_seqs": (dict(max_num_seqs=0), "max_num_seqs=0 must be a positive integer"),
    "prefill_chunk": (dict(prefill_chunk=0), "prefill_chunk=0 must be 'auto' or an integer >= 1"),
    "prefill_chunk word": (dict(prefill_chunk="big"), "prefill_chunk='big' must be 'auto' or an integer >= 1"),
    "page_size": (dict(page_size=-1), "page_size=-1 must be an integer >= 1"),
}


@pytest.mark.parametrize("case", sorted(BAD_OPTIONS))
@pytest.mark.parametrize("source", ["hf", "demo"])
def test_bad_option_is_refused(case, source, hf_checkpoint):
    options, message = BAD_OPTIONS[case]
    path = hf_checkpoint("qwen3") if source == "hf" else "demo:qwen3"
    with pytest.raises(ValueError, match=message):
        jaxspec.load(path, **{**HF_SETTINGS, **options})


def test_prefill_chunk_auto_is_512_on_gpus_and_64_elsewhere(hf_checkpoint):
    from jaxspec.loader import auto_prefill_chunk

    settings = {k: v for k, v in HF_SETTINGS.items() if k != "prefill_chunk"}
    model = jaxspec.load(hf_checkpoint("qwen3"), **settings)
    gpu = jax.default_backend() == "gpu"
    assert model.prefill_chunk == (min(512, settings["max_model_len"]) if gpu else 64) == auto_prefill_chunk(64)


@pytest.mark.parametrize("user", [None, "true"])
def test_gpu_pool_grows_on_demand_unless_the_user_says_otherwise(user):
    """Importing jaxspec turns the GPU backend's up-front reservation off (the engine plans its own
    KV pool; the reservation cost ~1.6 s of every H200 start-up); a user's own setting is kept."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_PYTHON_CLIENT_PREALLOCATE"}
    if user is not None:
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = user
    code = "import os, jaxspec; print(os.environ['XLA_PYTHON_CLIENT_PREALLOCATE'])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == (user or "false")


def test_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match=rf"model path '{tmp_path / 'nope'}' does not exist.*demo\[:family\]"):
        jaxspec.load(tmp_path / "nope")


@pytest.mark.parametrize("name", ["demo:llama", "demo:"])
def test_unknown_demo_family(name):
    family = name.split(":")[1]
    with pytest.raises(ValueError, match=rf"unknown demo family '{family}'; valid: qwen3, qwen3_5, qwen3_5_moe"):
        jaxspec.load(name)


# ---- demo models -------------------------------------------------------------------------------

@pytest.mark.parametrize("family", DEMO_FAMILIES)
def test_demo_family_generates_text(family):
    model = demo_model(family)
    assert isinstance(model.tokenizer, ByteTokenizer) and model.config.model_type.startswith(family)
    assert model.config.is_hybrid == (family not in ("qwen3", "qwen3_moe"))
    result = jaxspec.generate(model, "Hello, world", max_new_tokens=NEW_TOKENS)
    ids = result.token_ids[0]
    assert 1 <= len(ids) <= NEW_TOKENS and all(0 <= t < model.config.vocab_size for t in ids)
    assert isinstance(result.texts[0], str) and result.texts[0] == model.tokenizer.decode(ids)
    assert "tok/s" in result.stats.summary()


def test_default_demo_is_a_hybrid_qwen3_5():
    """"demo" is the shipped trained Qwen3.5-architecture model (GDN + gated attention) with its own
    tokenizer."""
    model = jaxspec.load("demo", **SETTINGS)
    assert model.config.family == "qwen3_5" and model.config.is_hybrid and model.tokenizer is not None
    result = jaxspec.generate(model, "def ", max_new_tokens=4)
    ids = result.token_ids[0]
    assert 1 <= len(ids) <= 4 and result.texts[0] == model.tokenizer.decode(ids)


# ---- save -> load ------------------------------------------------------------------------------

def assert_same_outputs(a, b, token_prompts):
    """Greedy tokens and score() logits exactly equal; b reuses a's executables (no recompiles)."""
    ra = jaxspec.generate(a, token_prompts, max_new_tokens=NEW_TOKENS)
    tokens = token_prompts[-1] + ra.token_ids[-1]
    scores = jaxspec.score(a, tokens)
    with count_compiles() as compiles:
        rb = jaxspec.generate(b, token_prompts, max_new_tokens=NEW_TOKENS)
        np.testing.assert_array_equal(jaxspec.score(b, tokens), scores)
    assert ra.token_ids == rb.token_ids and ra.texts == rb.texts
    assert compiles.backend_compiles == 0


def test_save_load_round_trip_hf_model(hf_checkpoint, tmp_path):
    model = jaxspec.load(hf_checkpoint("qwen3"), **HF_SETTINGS)
    saved = jaxspec.save(model, tmp_path / "saved")
    reloaded = jaxspec.load(saved, **HF_SETTINGS)
    assert reloaded.config == model.config and reloaded.tokenizer is None
    assert_trees_equal(reloaded.params, model.params)
    rng = np.random.default_rng(0)
    assert_same_outputs(model, reloaded, [rng.integers(0, 157, n).tolist() for n in (1, 7, 8, 9, 19)])


def fresh_demo(family: str) -> jaxspec.Model:
    """A demo model of its own, not the shared one: assert_same_outputs counts on the original
    creating its engine (running the cache allocation) in this test. The shared model's engine may
    come from an earlier file on the same worker, whose executables the suite releases after each
    module, so the reloaded model's allocation would compile once."""
    return jaxspec.load(f"demo:{family}", **SETTINGS)


def test_save_load_round_trip_demo_model_keeps_byte_tokenizer(tmp_path):
    model = fresh_demo("qwen3_5")
    saved = jaxspec.save(model, tmp_path / "saved")
    with count_compiles() as loading:
        reloaded = jaxspec.load(saved, **SETTINGS)
    assert loading.backend_compiles == 0  # weights are copied to the device, not staged by an executable per shape
    assert isinstance(reloaded.tokenizer, ByteTokenizer) and reloaded.config == model.config
    assert_trees_equal(reloaded.params, model.params)
    assert_same_outputs(model, reloaded, prompts())
    assert jaxspec.generate(reloaded, "hello", max_new_tokens=4).texts == \
        jaxspec.generate(model, "hello", max_new_tokens=4).texts


def test_saved_dtype_is_kept_by_auto(tmp_path):
    model = jaxspec.load("demo:qwen3", dtype="bfloat16", **SETTINGS)
    saved = jaxspec.save(model, tmp_path / "saved")
    reloaded = jaxspec.load(saved, **SETTINGS)
    assert reloaded.dtype == model.dtype == jax.numpy.bfloat16
    assert_trees_equal(reloaded.params, model.params)
    widened = jaxspec.load(saved, **{**SETTINGS, "dtype": "float32"})
    assert {x.dtype for x in jax.tree.leaves(widened.params)} == {np.dtype(np.float32)}


def test_orbax_format_round_trip_and_format_switch(tmp_path):
    """format="orbax" (params/, the multi-process format and that of earlier versions) loads into
    the same arrays, which reuse the executables of the saved model; saving again in the other
    format replaces the files; an unknown format is refused before anything is written."""
    model = fresh_demo("qwen3_5")
    saved = jaxspec.save(model, tmp_path / "saved", format="orbax")
    assert (saved / "params").is_dir() and not (saved / "params.safetensors").exists()
    reloaded = jaxspec.load(saved, **SETTINGS)
    assert_trees_equal(reloaded.params, model.params)
    assert_same_outputs(model, reloaded, prompts())
    jaxspec.save(model, saved)  # one process: safetensors by default
    assert (saved / "params.safetensors").is_file() and not (saved / "params").exists()
    with pytest.raises(ValueError, match=r"format='zarr'.*'safetensors', 'orbax'"):
        jaxspec.save(model, tmp_path / "other", format="zarr")
    assert not (tmp_path / "other").exists()


# ---- MTP weights through load ------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_mtp_weights_load_save_and_are_optional(kind, hf_checkpoint, tmp_path):
    with_mtp = jaxspec.load(hf_checkpoint(kind, mtp=True), **HF_SETTINGS)
    mtp = with_mtp.params["mtp"]
    assert with_mtp.config.mtp_num_hidden_layers == 1 and len(mtp["layers"]) == 1
    assert mtp["fc"].shape == (2 * with_mtp.config.hidden_size, with_mtp.config.hidden_size)
    reloaded = jaxspec.load(jaxspec.save(with_mtp, tmp_path / "saved"), **HF_SETTINGS)
    assert_trees_equal(reloaded.params, with_mtp.params)
    without = jaxspec.load(hf_checkpoint(kind), **HF_SETTINGS)
    assert "mtp" not in without.params and without.config.mtp_num_hidden_layers == 0
    trunk = {k: v for k, v in with_mtp.params.items() if k != "mtp"}
    assert jax.tree.structure(trunk) == jax.tree.structure(without.params)
