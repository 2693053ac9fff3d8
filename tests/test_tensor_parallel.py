"""Tensor parallelism (docs/architecture.md, "Tensor parallelism") on the suite's virtual CPU devices
(tests/conftest.py): greedy tokens on 2 and 4 devices equal one device's in float32 for every family,
speculative greedy equals plain under TP, the weights and caches really are sharded (and GDN shards
hold whole GVA groups), a decode step pays only the Megatron all-reduces, bad sizes are refused
before anything is read, executables precompiled for a mesh are the ones the run uses, save /
restore crosses meshes, and two processes joined by jax.distributed decode like one."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import jaxspec
from jaxspec import cache, sharding, weights
from jaxspec import compile as jc
from jaxspec.compile import count_compiles

pytestmark = pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 devices (tests/conftest.py gives the CPU 4)")

# This file runs in a fresh process of its own (tests/conftest.py, FRESH_PROCESS_FILES): jaxlib 0.10's
# XLA:CPU segfaulted compiling its prefill executables after other files had run in the same process.
# No persistent compilation cache: one of those crashes was inside the cache write of a 2-device
# executable, and the multi-device executables are not worth caching here.
SETTINGS = dict(dtype="float32", kernels="xla", max_model_len=40, max_num_seqs=3, prefill_chunk=8, page_size=4,
                cache_dir=None)
PROMPTS = [[5, 6, 7], list(range(10, 19)), list(range(40, 57))]  # 3, 9, 17 tokens: across chunks and pages
NEW = 8
# fixture kind -> tensor-parallel sizes its tiny model divides (hybrids have 2 GDN key heads; qwen3 at 4
# has fewer kv heads (2) than devices: the KV cache repeats them).
SIZES = {"qwen3": (2, 4), "qwen3_moe": (2, 4), "qwen3_5": (2,), "qwen3_5_wrapped": (2,), "qwen3_5_moe": (2,),
         "qwen3_next": (2,)}
REPO = Path(__file__).resolve().parents[1]


def load(path, tp: int, **settings) -> jaxspec.Model:
    model = jaxspec.load(path, tensor_parallel_size=tp, **{**SETTINGS, **settings})
    model.request_buckets = (len(PROMPTS),)  # one decode executable per model
    return model


@pytest.fixture(scope="module")
def models(hf_checkpoint):
    """models(kind, tp, **checkpoint options) -> Model, loaded once per module; kind "<kind>-draft"
    is <kind> with its params perturbed (a draft model that agrees with its target often)."""
    loaded = {}

    def get(kind: str, tp: int, **options):
        key = (kind, tp, json.dumps(options, sort_keys=True))
        if key not in loaded:
            path = hf_checkpoint(kind.removesuffix("-draft"), **options)
            model = loaded[key] = load(path, tp)
            if kind.endswith("-draft"):
                rng = np.random.default_rng(1)
                noisy = [np.asarray(x) * (1 + 0.04 * rng.standard_normal(x.shape)).astype(x.dtype)
                         for x in jax.tree_util.tree_leaves(model.params)]
                model.params = jax.device_put(jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(model.params),
                                                                           noisy),
                                              sharding.param_shardings(model.config, model.params))
        return loaded[key]

    return get


def greedy(model, **kw):
    return jaxspec.generate(model, PROMPTS, max_new_tokens=NEW, **kw)


@pytest.mark.parametrize("kind", sorted(SIZES))
def test_greedy_tokens_equal_one_device(kind, models):
    reference = greedy(models(kind, 1)).token_ids
    for tp in SIZES[kind]:
        assert greedy(models(kind, tp)).token_ids == reference, f"tensor_parallel_size={tp}"


@pytest.mark.parametrize("method, kind, options", [("ngram", "qwen3", {}), ("draft_model", "qwen3", {}),
                                                   ("mtp", "qwen3_5", {"mtp": True})])
def test_speculative_greedy_equals_plain_under_tp(method, kind, options, models):
    """Lossless, and the same drafts as on one device (equal acceptance by position, not zero: a
    drafter computing wrong drafts on the mesh would accept differently). The MTP case uses a
    random hybrid with random mtp.* weights (the trained demo's 5 attention heads do not split over
    2 devices); at these seeds its head's drafts match the target once."""
    accepted = {}
    for tp in (1, 2):
        target = models(kind, tp, **options)
        draft = models(kind + "-draft", tp) if method == "draft_model" else None
        spec = jaxspec.SpeculativeConfig(method, 3, draft_model=draft)
        out = greedy(target, speculative=spec)
        assert out.token_ids == greedy(target).token_ids, f"tensor_parallel_size={tp}"
        accepted[tp] = out.stats.accepted, out.stats.accepted_by_position
    assert accepted[2] == accepted[1] and accepted[1][0] > 0


def test_tap_drafters_under_tp_equal_one_device(hf_checkpoint, tmp_path):
    """EAGLE-3 and DFlash heads (replicated) read the taps of a sharded target: lossless, with the
    drafts and acceptance of one device (a 4-token vocabulary so random heads get drafts accepted)."""
    from tests.speculative.tap_checkpoints import write_dflash, write_eagle3

    path = hf_checkpoint("qwen3_5", vocab_size=4)
    accepted = {}
    for tp in (1, 2):
        target = load(path, tp)
        target.config = target.config.replace(eos_token_ids=())
        H = target.config.hidden_size
        heads = {"eagle3": write_eagle3(tmp_path / f"e{tp}", hidden=H, vocab=4, draft_vocab=3),
                 "dflash": write_dflash(tmp_path / f"d{tp}", hidden=H, vocab=4, target_layer_ids=(0, 2),
                                        mask_token_id=3, block_size=4)}
        prompts = [[p % 4 for p in prompt] for prompt in PROMPTS]
        plain = jaxspec.generate(target, prompts, max_new_tokens=NEW).token_ids
        for method, head in heads.items():
            out = jaxspec.generate(target, prompts, max_new_tokens=NEW,
                                   speculative=jaxspec.SpeculativeConfig(method, 3, draft_model=str(head)))
            assert out.token_ids == plain, f"{method}, tensor_parallel_size={tp}"
            accepted[method, tp] = out.stats.accepted
    for method in ("eagle3", "dflash"):
        assert accepted[method, 2] == accepted[method, 1] > 0, accepted


def shard_shape(x):
    return x.addressable_shards[0].data.shape


def test_weights_and_caches_are_sharded(models):
    model = models("qwen3_next", 2)
    cfg, p = model.config, model.params
    gdn, attn = p["layers"][0]["gdn"], p["layers"][1]["attn"]
    moe = p["layers"][0]["moe"]
    H, V, E, Ie = cfg.hidden_size, cfg.vocab_size, cfg.num_experts, cfg.moe_intermediate_size
    assert shard_shape(p["embed"]) == (V // 2, H) and shard_shape(p["lm_head"]) == (H, V // 2)
    assert shard_shape(attn["q"]) == (H, attn["q"].shape[1] // 2)
    assert shard_shape(attn["o"]) == (attn["o"].shape[0] // 2, H)
    assert shard_shape(attn["k"]) == (H, attn["k"].shape[1] // 2)  # 2 kv heads over 2 devices
    assert shard_shape(gdn["qkv"]) == (H, cfg.gdn_conv_dim // 2)
    assert shard_shape(gdn["out"]) == (gdn["out"].shape[0] // 2, H)
    assert shard_shape(gdn["A_log"]) == (cfg.linear_num_value_heads // 2,)
    assert shard_shape(moe["gate"]) == (E, H, Ie // 2) and shard_shape(moe["down"]) == (E, Ie // 2, H)
    assert shard_shape(moe["shared"]["up"])[1] == cfg.shared_expert_intermediate_size // 2
    assert moe["router"].sharding.is_fully_replicated
    total = sum(x.nbytes for x in jax.tree_util.tree_leaves(p))
    assert cache.params_bytes(p) < 0.6 * total  # per device: little beyond norms and routers is whole

    caches = model.engine(0).caches
    kv, ssm, conv = caches["kv"][0][0], caches["ssm"][0], caches["conv"][0]
    assert shard_shape(kv)[2] == cfg.num_key_value_heads // 2
    assert shard_shape(ssm)[1] == cfg.linear_num_value_heads // 2 and shard_shape(conv)[2] == cfg.gdn_conv_dim // 2

    # At 4 devices the 2 kv heads stay whole in the weights; the cache holds one (repeated) head each.
    small = models("qwen3", 4)
    assert small.params["layers"][0]["attn"]["k"].sharding.is_fully_replicated
    kv4 = small.engine(0).caches["kv"][0][0]
    assert kv4.shape[2] == 4 and shard_shape(kv4)[2] == 1


def test_gdn_shard_holds_whole_key_head_groups(models, hf_checkpoint):
    """Device 0's columns of qkv are [q | k | v] of key head 0 and its value heads, read from HF's
    flat in_proj_qkv rows (Qwen3.5) -- the GVA grouping survives the split."""
    model = models("qwen3_5", 2)
    cfg = model.config
    hf = weights.read_checkpoint_tensors(hf_checkpoint("qwen3_5"))["model.layers.0.linear_attn.in_proj_qkv.weight"]
    HK, dk, dv, r = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim, 2
    rows = np.r_[0:dk, HK * dk:HK * dk + dk, 2 * HK * dk:2 * HK * dk + r * dv]  # head 0's q, k, v
    shard = np.asarray(model.params["layers"][0]["gdn"]["qkv"].addressable_shards[0].data)
    np.testing.assert_array_equal(shard, hf[rows].T)


def test_decode_step_pays_only_the_megatron_all_reduces(models):
    """Greedy decode on 2 devices: one all-reduce after each mixer and each MLP / MoE, one for the
    vocab-sharded embedding lookup, two tiny all-gathers of per-shard (max, argmax): nothing that
    moves activations between layouts (all-to-all, permutes) or weights."""
    model = models("qwen3_next", 2)
    table = jc.bucket_table(model, sampling=("greedy",))
    [(bucket, counts)] = jc.step_collectives(model, table)
    assert bucket.name == "decode" and bucket.tp == 2
    assert counts == {"all-reduce": 2 * model.config.num_hidden_layers + 1, "all-gather": 2}


@pytest.mark.parametrize("tp, message", [
    (3, r"tensor_parallel_size=3 does not divide num_attention_heads=4; sizes this model allows: 1, 2, 4"),
    (8, r"tensor_parallel_size=8 exceeds the 4 cpu device\(s\) present"),
    (0, r"tensor_parallel_size=0 must be a positive integer"),
])
def test_bad_sizes_are_refused_before_reading(tp, message, models, hf_checkpoint, monkeypatch):
    model = models("qwen3", 2)
    with monkeypatch.context() as patch:
        patch.setattr(weights, "open_checkpoint", lambda *_: pytest.fail("read weights before refusing"))
        with pytest.raises(ValueError, match=message):
            load(hf_checkpoint("qwen3"), tp)
        with pytest.raises(ValueError, match="does not divide linear_num_key_heads=2"):
            load(hf_checkpoint("qwen3_5"), 4)
    draft = models("qwen3", 1)
    with pytest.raises(ValueError, match="draft model is loaded with tensor_parallel_size=1, the target with 2"):
        greedy(model, speculative=jaxspec.SpeculativeConfig("draft_model", 2, draft_model=draft))
    assert greedy(model).token_ids == greedy(models("qwen3", 1)).token_ids  # still usable


def test_precompiled_executables_serve_the_mesh_with_no_compile(hf_checkpoint):
    """The AOT-compiled table carries the run's shardings, so generate finds every executable in the
    persistent cache; a second generate traces nothing."""
    model = load(hf_checkpoint("qwen3"), 2, max_num_seqs=1)
    model.request_buckets = ()
    jc.precompile(model, jc.bucket_table(model, sampling=("greedy",)), progress=False)
    with count_compiles() as first:
        jaxspec.generate(model, PROMPTS[:1], max_new_tokens=NEW)
    with count_compiles() as steady:
        jaxspec.generate(model, PROMPTS[1:2], max_new_tokens=NEW)
    assert first.backend_compiles == 0  # in process, precompile left every executable compiled
    assert steady.traces == 0 and steady.backend_compiles == 0


def test_save_restores_into_shards_on_any_mesh(models, tmp_path):
    model = models("qwen3_next", 2)
    jaxspec.save(model, tmp_path / "saved")
    one, two = load(tmp_path / "saved", 1), load(tmp_path / "saved", 2)
    reference = models("qwen3_next", 1).params
    for a, b in zip(jax.tree_util.tree_leaves(one.params), jax.tree_util.tree_leaves(reference), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert shard_shape(two.params["layers"][0]["gdn"]["qkv"])[1] == model.config.gdn_conv_dim // 2
    assert greedy(two).token_ids == greedy(model).token_ids


def test_cli_info_shows_mesh_memory_and_collectives(capsys):
    from jaxspec import cli

    args = ["info", "--model", "demo:qwen3", "--max-model-len", "32", "--max-num-seqs", "1", "--no-cache"]
    assert cli.main([*args, "--tensor-parallel-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "mesh: tensor parallel 2 over devices [0, 1]" in out and "per device: weights" in out
    assert "collectives per step" in out and f"{2 * 4 + 1} all-reduce" in out  # 4 layers
    assert cli.main([*args, "--tensor-parallel-size", "3"]) == 2
    assert "tensor_parallel_size=3 does not divide num_attention_heads=4" in capsys.readouterr().err


TWO_PROCESSES = """
import json, sys
import jaxspec
jaxspec.initialize_distributed(f"localhost:{sys.argv[1]}", 2, int(sys.argv[2]))
m = jaxspec.load(sys.argv[3], tensor_parallel_size=2, **json.loads(sys.argv[4]))  # SETTINGS: no disk cache
print("TOKENS", json.dumps(jaxspec.generate(m, json.loads(sys.argv[5]), max_new_tokens=int(sys.argv[6])).token_ids))
"""


def test_two_processes_decode_like_one(models, hf_checkpoint):
    """Two CPU processes of one device each (gloo collectives), joined by jax.distributed, run the
    same loop on their shards and both return one process's tokens."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu",
               XLA_FLAGS=os.environ.get("XLA_FLAGS", "").replace("device_count=4", "device_count=1"))
    args = [str(port), "", str(hf_checkpoint("qwen3_next")), json.dumps(SETTINGS), json.dumps(PROMPTS), str(NEW)]
    procs = [subprocess.Popen([sys.executable, "-c", TWO_PROCESSES, *(args[:1] + [str(i)] + args[2:])], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    reference = greedy(models("qwen3_next", 1)).token_ids
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-3000:]
        tokens = [line for line in out.splitlines() if line.startswith("TOKENS ")]
        assert tokens and json.loads(tokens[-1][len("TOKENS "):]) == reference, out[-3000:]
