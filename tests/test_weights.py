"""HF checkpoints -> params -> HF, saved-params round trips, checkpoint errors, tokenizers."""

from __future__ import annotations

import json
import logging
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

from jaxspec.config import FULL, ModelConfig
from jaxspec.saved import restore_params, save_params
from jaxspec.tokenizer import ByteTokenizer, HFTokenizer, eos_token_ids, load_tokenizer
from jaxspec.weights import (
    CheckpointError,
    hf_to_params,
    open_checkpoint,
    params_to_hf,
    read_checkpoint_tensors,
    write_safetensors,
)
from tests.hf_fixtures import KINDS, VOCAB, make_hf_checkpoint, mtp_tensors

HYBRID = ("qwen3_5", "qwen3_5_wrapped", "qwen3_5_moe", "qwen3_next")
MOE = ("qwen3_moe", "qwen3_5_moe", "qwen3_next")


def load(directory, dtype="float32"):
    cfg = ModelConfig.from_hf(json.loads((directory / "config.json").read_text()))
    tensors = read_checkpoint_tensors(directory)
    return cfg, tensors, hf_to_params(cfg, tensors, dtype)


def text_tensors(tensors):
    return {k: v for k, v in tensors.items() if not k.startswith("model.visual.")}


def assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=False):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# ---- expected shapes, written from docs/architecture.md (independent of weights.py) -----------

def layer_shapes(cfg: ModelConfig, mixer: str, mlp: str) -> dict:
    H, D, nH, nKV = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    out = {"input_norm": (H,), "post_norm": (H,)}
    if mixer == FULL:
        q = nH * D * (2 if cfg.attn_output_gate else 1)
        out["attn"] = {"q": (H, q), "k": (H, nKV * D), "v": (H, nKV * D), "o": (nH * D, H),
                       "q_norm": (D,), "k_norm": (D,)}
    else:
        HV, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
        out["gdn"] = {"qkv": (H, cfg.gdn_conv_dim), "z": (H, HV * dv), "b": (H, HV), "a": (H, HV),
                      "conv": (cfg.linear_conv_kernel_dim, cfg.gdn_conv_dim), "A_log": (HV,), "dt_bias": (HV,),
                      "norm": (dv,), "out": (HV * dv, H)}
    if mlp == "moe":
        E, Ie, S = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
        out["moe"] = {"router": (H, E), "gate": (E, H, Ie), "up": (E, H, Ie), "down": (E, Ie, H)}
        if S:
            out["moe"]["shared"] = {"gate": (H, S), "up": (H, S), "down": (S, H)}
            out["moe"]["shared_gate"] = (H, 1)
    else:
        inner = cfg.intermediate_size
        out["mlp"] = {"gate": (H, inner), "up": (H, inner), "down": (inner, H)}
    return out


def expected_shapes(cfg: ModelConfig) -> dict:
    V, H = cfg.vocab_size, cfg.hidden_size
    out = {"embed": (V, H), "norm": (H,),
           "layers": [layer_shapes(cfg, cfg.layer_types[i], cfg.mlp_kinds[i]) for i in range(cfg.num_hidden_layers)]}
    if not cfg.tie_word_embeddings:
        out["lm_head"] = (H, V)
    return out


def shapes_of(params) -> dict:
    return jax.tree.map(lambda x: tuple(x.shape), params)


# ---- every family ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_shapes_match_config(hf_checkpoint, kind):
    cfg, _, params = load(hf_checkpoint(kind))
    assert shapes_of(params) == expected_shapes(cfg)
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(params))
    assert cfg.is_hybrid == (kind in HYBRID) and ("moe" in cfg.mlp_kinds) == (kind in MOE)


@pytest.mark.parametrize("kind", KINDS)
def test_params_to_hf_inverts_hf_to_params_exactly(hf_checkpoint, kind):
    cfg, tensors, params = load(hf_checkpoint(kind))
    back, original = params_to_hf(cfg, params), text_tensors(tensors)
    assert sorted(back) == sorted(original)
    for name, t in original.items():
        assert back[name].dtype == t.dtype, name
        np.testing.assert_array_equal(back[name], t, err_msg=name)


@pytest.fixture(scope="session")
def hf_models(hf_checkpoint):
    """kind -> the HF torch model loaded from the fixture checkpoint (in-memory HF layout)."""
    import transformers as tf
    cache = {}

    def get(kind):
        if kind not in cache:
            cls = tf.Qwen3_5ForConditionalGeneration if kind == "qwen3_5_wrapped" else tf.AutoModelForCausalLM
            cache[kind] = cls.from_pretrained(hf_checkpoint(kind)).eval()
        return cache[kind]
    return get


def text_model(model):
    inner = model.model
    return inner.language_model if hasattr(inner, "language_model") else inner


@pytest.mark.parametrize("kind", KINDS)
def test_values_match_hf_modules(hf_checkpoint, hf_models, kind):
    """Projections through our [in, out] params equal HF's own modules on the same input."""
    cfg, _, params = load(hf_checkpoint(kind))
    model = text_model(hf_models(kind))
    x = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    xn = x.numpy()
    np.testing.assert_array_equal(np.asarray(params["embed"]), model.embed_tokens.weight.detach().numpy())
    for i, (layer, hf_layer) in enumerate(zip(params["layers"], model.layers, strict=False)):
        if cfg.layer_types[i] == FULL:
            with torch.no_grad():
                q = hf_layer.self_attn.q_proj(x).numpy()
            np.testing.assert_allclose(xn @ np.asarray(layer["attn"]["q"]), q, rtol=1e-5, atol=1e-5)
        else:
            check_gdn_projections(cfg, layer["gdn"], hf_layer.linear_attn, x)
        if cfg.mlp_kinds[i] == "moe":
            check_experts(cfg, layer["moe"], hf_layer.mlp)


def _grouped(cfg, flat):
    """[..., q | k | v] channels -> [..., (q_h | k_h | v_h) per key head h], our stored layout."""
    HK, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
    q, k, v = np.split(flat, [HK * dk, 2 * HK * dk], axis=-1)
    lead = flat.shape[:-1]
    parts = [t.reshape(*lead, HK, -1) for t in (q, k, v)]
    return np.concatenate(parts, axis=-1).reshape(*lead, -1)


def check_gdn_projections(cfg, gdn, hf_gdn, x):
    """HF's split (grouped reorder for Qwen3-Next) == x @ our grouped qkv / z / b / a."""
    HV, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    with torch.no_grad():
        if cfg.family == "qwen3_next":
            qkvz, ba = hf_gdn.in_proj_qkvz(x[None]), hf_gdn.in_proj_ba(x[None])
            q, k, v, z, b, a = hf_gdn.fix_query_key_value_ordering(qkvz, ba)
            q, k, v, z, b, a = (t[0].reshape(5, -1).numpy() for t in (q, k, v, z, b, a))
            qkv = np.concatenate([q, k, v], axis=-1)
        else:
            qkv, z, b, a = (m(x).numpy() for m in (hf_gdn.in_proj_qkv, hf_gdn.in_proj_z, hf_gdn.in_proj_b,
                                                    hf_gdn.in_proj_a))
    xn = x.numpy()
    for key, ref in (("qkv", _grouped(cfg, qkv)), ("z", z), ("b", b), ("a", a)):
        np.testing.assert_allclose(xn @ np.asarray(gdn[key]), ref, rtol=1e-5, atol=1e-5, err_msg=key)
    conv = hf_gdn.conv1d.weight.detach().numpy()[:, 0, :].T  # [K, C]
    np.testing.assert_array_equal(np.asarray(gdn["conv"]), _grouped(cfg, conv))
    assert z.shape[-1] == HV * dv


def check_experts(cfg, moe, hf_moe):
    """Our stacked experts against HF's in-memory fused gate_up_proj [E, 2I, H] / down_proj [E, H, I]."""
    Ie = cfg.moe_intermediate_size
    gate_up = hf_moe.experts.gate_up_proj.detach().numpy()
    down = hf_moe.experts.down_proj.detach().numpy()
    np.testing.assert_array_equal(np.asarray(moe["gate"]), gate_up[:, :Ie].transpose(0, 2, 1))
    np.testing.assert_array_equal(np.asarray(moe["up"]), gate_up[:, Ie:].transpose(0, 2, 1))
    np.testing.assert_array_equal(np.asarray(moe["down"]), down.transpose(0, 2, 1))


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen3_5_moe"])
def test_fused_expert_layout_loads_identically(hf_checkpoint, hf_models, kind, tmp_path):
    """transformers' own fused layout (save_original_format=False) and our fused export."""
    hf_models(kind).save_pretrained(tmp_path, save_original_format=False)
    tensors = read_checkpoint_tensors(tmp_path)
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in tensors)
    assert not any(".mlp.experts.0." in k for k in tensors)
    cfg, _original, params = load(hf_checkpoint(kind))
    assert_trees_equal(hf_to_params(cfg, tensors, "float32"), params)
    fused = params_to_hf(cfg, params, fused_experts=True)
    assert_trees_equal(hf_to_params(cfg, fused, "float32"), params)


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_next", "qwen3_5_wrapped"])
def test_sharded_checkpoint_loads_identically(hf_checkpoint, kind):
    sharded = hf_checkpoint(kind, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").exists() and len(list(sharded.glob("*.safetensors"))) > 1
    assert_trees_equal(load(sharded)[2], load(hf_checkpoint(kind))[2])


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5_wrapped", "qwen3_5_moe"])
def test_tied_embeddings(hf_checkpoint, kind):
    directory = hf_checkpoint(kind, tie_word_embeddings=True)
    cfg, tensors, params = load(directory)
    assert cfg.tie_word_embeddings and "lm_head" not in params and "lm_head.weight" not in tensors
    assert sorted(params_to_hf(cfg, params)) == sorted(text_tensors(tensors))
    untied_cfg, _, untied = load(hf_checkpoint(kind))
    assert not untied_cfg.tie_word_embeddings and untied["lm_head"].shape == (cfg.hidden_size, VOCAB)


@pytest.mark.parametrize("overrides", [{"num_key_value_heads": 1, "linear_num_value_heads": 6},
                                       {"num_key_value_heads": 4, "linear_num_value_heads": 2}])
def test_gqa_and_gva_ratios(hf_checkpoint, overrides):
    """r = HV/HK in {3, 1}: the Qwen3-Next reorder still inverts exactly and matches shapes."""
    cfg, tensors, params = load(hf_checkpoint("qwen3_next", **overrides))
    assert cfg.linear_num_value_heads == overrides["linear_num_value_heads"]
    assert shapes_of(params) == expected_shapes(cfg)
    back = params_to_hf(cfg, params)
    for name, t in tensors.items():
        np.testing.assert_array_equal(back[name], t, err_msg=name)
    import transformers as tf
    model = tf.AutoModelForCausalLM.from_pretrained(hf_checkpoint("qwen3_next", **overrides))
    x = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    check_gdn_projections(cfg, params["layers"][0]["gdn"], model.model.layers[0].linear_attn, x)


# ---- dtypes ----------------------------------------------------------------------------------------

def test_dtypes(hf_checkpoint):
    cfg, tensors, f32 = load(hf_checkpoint("qwen3_5"))
    assert {x.dtype for x in jax.tree.leaves(f32)} == {jnp.dtype(jnp.float32)}
    auto = hf_to_params(cfg, tensors, "auto")  # config dtype is float32
    assert_trees_equal(auto, f32)
    bf16 = hf_to_params(cfg, tensors, "bfloat16")
    assert_trees_equal(bf16, jax.tree.map(lambda x: x.astype(jnp.bfloat16), f32))
    for bad in ("float16", "fp32", None):
        with pytest.raises(ValueError, match=f"dtype={bad!r}.*valid: auto, bfloat16, float32"):
            hf_to_params(cfg, tensors, bad)


def test_bfloat16_checkpoint_reads_and_auto_keeps_bf16(hf_checkpoint, tmp_path):
    src = hf_checkpoint("qwen3_next")
    _cfg, tensors, f32 = load(src)
    bf = {k: np.asarray(v).astype(ml_dtypes.bfloat16) for k, v in tensors.items()}
    write_safetensors(bf, tmp_path / "model.safetensors")
    config = json.loads((src / "config.json").read_text()) | {"dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    cfg16, read, params = load(tmp_path, "auto")
    assert cfg16.torch_dtype == "bfloat16" and read["model.norm.weight"].dtype == ml_dtypes.bfloat16
    assert_trees_equal(params, jax.tree.map(lambda x: x.astype(jnp.bfloat16), f32))
    assert all(np.array_equal(v, bf[k]) for k, v in params_to_hf(cfg16, params).items())
    torch_read = __import__("safetensors.torch", fromlist=["load_file"]).load_file(tmp_path / "model.safetensors")
    assert torch_read["model.norm.weight"].dtype == torch.bfloat16  # the reference reader agrees


# ---- vision tower and MTP ----------------------------------------------------------------------------

def test_wrapped_checkpoint_skips_vision_weights(hf_checkpoint, caplog):
    directory = hf_checkpoint("qwen3_5_wrapped")
    tensors = read_checkpoint_tensors(directory)
    assert any(k.startswith("model.visual.") for k in tensors)
    cfg = ModelConfig.from_hf(json.loads((directory / "config.json").read_text()))
    with caplog.at_level(logging.INFO, logger="jaxspec.weights"):
        params = hf_to_params(cfg, tensors, "float32")
    assert "model.visual" in caplog.text
    assert cfg.wrapped and shapes_of(params) == expected_shapes(cfg)


@pytest.mark.parametrize("kind,options", [("qwen3_5", {}), ("qwen3_5_wrapped", {}), ("qwen3_5_moe", {}),
                                          ("qwen3_next", {"max_shard_size": "100KB"})])
def test_mtp_weights_land_in_params(hf_checkpoint, kind, options):
    directory = hf_checkpoint(kind, mtp=True, **options)
    cfg, tensors, params = load(directory)
    H, mtp = cfg.hidden_size, params["mtp"]
    assert cfg.mtp_num_hidden_layers == 1 and len(mtp["layers"]) == 1
    np.testing.assert_array_equal(np.asarray(mtp["fc"]), tensors["mtp.fc.weight"].T)
    assert shapes_of(mtp["layers"][0]) == layer_shapes(cfg, FULL, "moe" if cfg.num_experts else "dense")
    assert {k: shapes_of(v) for k, v in mtp.items() if k != "layers"} == {
        "fc": (2 * H, H), "pre_fc_norm_embedding": (H,), "pre_fc_norm_hidden": (H,), "norm": (H,)}
    expected = mtp_tensors(hf_checkpoint(kind, **options), seed=1)  # what add_mtp_weights wrote
    back = params_to_hf(cfg, params)
    for name, t in expected.items():
        np.testing.assert_array_equal(back[name], t, err_msg=name)
    assert "mtp" not in load(hf_checkpoint(kind, **options))[2]


# ---- errors -------------------------------------------------------------------------------------------

def copy_checkpoint(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_missing_directory_and_no_files(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        read_checkpoint_tensors(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="no safetensors files"):
        read_checkpoint_tensors(tmp_path)


def test_missing_shard(hf_checkpoint, tmp_path):
    d = copy_checkpoint(hf_checkpoint("qwen3", max_shard_size="100KB"), tmp_path / "c")
    shard = max(d.glob("model-*.safetensors"))
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"references shard '{shard.name}'"):
        read_checkpoint_tensors(d)


def test_index_entry_absent_from_its_shard(hf_checkpoint, tmp_path):
    d = copy_checkpoint(hf_checkpoint("qwen3", max_shard_size="100KB"), tmp_path / "c")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.9.mlp.up_proj.weight"] = min(set(index["weight_map"].values()))
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="'model.layers.9.mlp.up_proj.weight' to shard 'model-00001"):
        read_checkpoint_tensors(d)


def test_unused_tensors_are_reported(hf_checkpoint, caplog):
    cfg, tensors, _ = load(hf_checkpoint("qwen3_5_moe"))
    with caplog.at_level(logging.INFO, logger="jaxspec.weights"):
        hf_to_params(cfg, tensors)
    assert not caplog.records  # every tensor of a clean checkpoint is consumed
    with caplog.at_level(logging.WARNING, logger="jaxspec.weights"):
        hf_to_params(cfg, dict(tensors, **{"model.layers.0.self_attn.rogue.weight": np.zeros(2, np.float32)}))
    assert "model.layers.0.self_attn.rogue.weight" in caplog.text


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty", "bad_header_json"])
def test_corrupt_or_truncated_file_is_named(hf_checkpoint, tmp_path, damage):
    d = copy_checkpoint(hf_checkpoint("qwen3"), tmp_path / "c")
    f = d / "model.safetensors"
    data = f.read_bytes()
    n = int.from_bytes(data[:8], "little")
    f.write_bytes({"truncate": data[:-100], "garbage": b"\xff" * 64, "empty": b"",
                   "bad_header_json": data[:8] + b"{" * n + data[8 + n:]}[damage])
    with pytest.raises(CheckpointError, match=str(f)):
        read_checkpoint_tensors(d)


def test_missing_tensor_and_shape_mismatch(hf_checkpoint):
    cfg, tensors, _ = load(hf_checkpoint("qwen3_next"))
    name = "model.layers.0.linear_attn.in_proj_ba.weight"
    with pytest.raises(CheckpointError, match=f"missing tensor '{name}'"):
        hf_to_params(cfg, {k: v for k, v in tensors.items() if k != name})
    bad = dict(tensors, **{"model.layers.1.self_attn.q_proj.weight": np.zeros((3, 48), np.float32)})
    with pytest.raises(CheckpointError, match=r"'model.layers.1.self_attn.q_proj.weight' has shape \[3, 48\], "
                                              r"expected \[128, 48\]"):
        hf_to_params(cfg, bad)
    with pytest.raises(CheckpointError, match="model.layers.0.mlp.experts.3.down_proj.weight"):
        hf_to_params(cfg, {k: v for k, v in tensors.items() if k != "model.layers.0.mlp.experts.3.down_proj.weight"})


# ---- writing checkpoints, orbax --------------------------------------------------------------------------

def test_exported_checkpoint_loads_in_transformers(hf_checkpoint, hf_models, tmp_path):
    import transformers as tf
    src = hf_checkpoint("qwen3_next")
    cfg, _, params = load(src)
    write_safetensors(params_to_hf(cfg, params), tmp_path / "model.safetensors")
    shutil.copy(src / "config.json", tmp_path / "config.json")
    reloaded = tf.AutoModelForCausalLM.from_pretrained(tmp_path).state_dict()
    for name, t in hf_models("qwen3_next").state_dict().items():
        torch.testing.assert_close(reloaded[name], t, rtol=0, atol=0, msg=name)


def test_saved_params_round_trip_is_exact_and_overwrite_safe(hf_checkpoint, tmp_path):
    cfg, tensors, params = load(hf_checkpoint("qwen3_5_moe", mtp=True))
    (tmp_path / "config.json").write_text("{}")
    save_params(params, tmp_path)
    restored = restore_params(tmp_path, jnp.float32)
    assert_trees_equal(restored, params)
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(restored))
    bf16 = hf_to_params(cfg, tensors, "bfloat16")
    save_params(bf16, tmp_path)  # overwrite in place
    assert_trees_equal(restore_params(tmp_path, jnp.bfloat16), bf16)
    widened = restore_params(tmp_path, jnp.float32)  # a dtype other than the saved one
    assert_trees_equal(widened, jax.tree.map(lambda x: x.astype(jnp.float32), bf16))
    assert (tmp_path / "config.json").read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "params.safetensors"]
    with pytest.raises(CheckpointError, match="no saved params"):
        restore_params(tmp_path / "elsewhere", jnp.float32)


# ---- tokenizers -----------------------------------------------------------------------------------

def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer(300)
    text = "héllo, wörld — ☃\n"
    ids = tok.encode(text)
    assert ids == list(text.encode()) and max(ids) < 256
    assert tok.decode(ids + [tok.eos_token_id, tok.bos_token_id, 299]) == text
    assert tok.eos_token_ids == (tok.eos_token_id,) and 256 <= tok.bos_token_id < tok.eos_token_id < 300
    assert tok.decode([0xE2, 0x98]) == "\ufffd"  # a cut multi-byte character is replaced, not raised
    with pytest.raises(ValueError, match="vocab_size=100"):
        ByteTokenizer(100)
    with pytest.raises(ValueError, match="token id 300"):
        tok.decode([300])


@pytest.fixture(scope="session")
def bpe_dir(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 50 + ["héllo wörld"] * 10, trainer)
    d = tmp_path_factory.mktemp("bpe")
    tok.save(str(d / "tokenizer.json"))
    (d / "config.json").write_text(json.dumps({"eos_token_id": 0}))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 0]}))
    return d


def test_hf_tokenizer_round_trip(bpe_dir):
    tok = load_tokenizer(bpe_dir)
    assert isinstance(tok, HFTokenizer) and 256 < tok.vocab_size <= 300
    for text in ("the lazy fox", "héllo wörld", "unseen: zebra 123 ☃"):
        ids = tok.encode(text)
        assert tok.decode(ids) == text
    assert tok.decode(tok.encode("the dog") + [1]) == "the dog"  # special tokens skipped
    assert tok.eos_token_ids == (1, 0)


def test_eos_token_ids_sources(bpe_dir, hf_checkpoint, tmp_path):
    assert eos_token_ids(bpe_dir) == (1, 0)  # generation_config.json wins
    assert eos_token_ids(tmp_path, {"eos_token_id": 7}) == (7,)
    assert eos_token_ids(tmp_path, {"eos_token_id": [7, 8]}) == (7, 8)
    assert eos_token_ids(tmp_path, {"text_config": {"eos_token_id": 5}}) == (5,)
    assert eos_token_ids(tmp_path, {}) == ()
    assert eos_token_ids(hf_checkpoint("qwen3_5_wrapped")) == (VOCAB - 1, VOCAB - 2)
    assert load_tokenizer(tmp_path) is None
    with pytest.raises(ValueError, match="eos_token_id='x'"):
        eos_token_ids(tmp_path, {"eos_token_id": "x"})


# ---- the fixtures themselves -------------------------------------------------------------------------

def test_fixture_is_seeded(hf_checkpoint, tmp_path):
    again = make_hf_checkpoint("qwen3", tmp_path)
    a, b = read_checkpoint_tensors(again), read_checkpoint_tensors(hf_checkpoint("qwen3"))
    assert sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)
    cfg = ModelConfig.from_hf(json.loads((again / "config.json").read_text()))
    assert cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size


@pytest.mark.parametrize("kind", KINDS)
def test_fixture_logits_are_not_degenerate(hf_models, kind):
    ids = (torch.arange(12)[None] * 37) % VOCAB
    with torch.no_grad():
        logits = hf_models(kind)(input_ids=ids).logits[0]
    assert logits.std(-1).min() > 0.3 and len(set(logits.argmax(-1).tolist())) > 3


def test_checkpoint_tensors_are_memory_mapped_views(tmp_path):
    """open_checkpoint reads nothing up front: every tensor is a view of the file's memory map, read
    only when touched (docs/benchmarks.md, "Compile and start-up"), with the stored dtype and shape;
    a file whose tensors hold no bytes opens too."""
    tensors = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.arange(5).astype(ml_dtypes.bfloat16),
               "i": np.arange(6, dtype=np.int32).reshape(2, 3)}
    opened = open_checkpoint(write_safetensors(tensors, tmp_path / "t.safetensors"))
    for name, want in tensors.items():
        got = opened[name]
        assert isinstance(got.base, np.memmap) or isinstance(got, np.memmap), name
        assert got.dtype == want.dtype and got.shape == want.shape and (got == want).all(), name
    empty = open_checkpoint(write_safetensors({"e": np.zeros((0, 4), np.float32)}, tmp_path / "e.safetensors"))
    assert empty["e"].shape == (0, 4) and empty["e"].dtype == np.float32


def test_write_safetensors_keeps_scalars_and_orders_strided_arrays(tmp_path):
    """A 0-d tensor is stored with shape [] (not [1]) and a transposed view in C order; both read
    back exactly, through the safetensors library and through jaxspec's own reader."""
    from safetensors.numpy import load_file

    tensors = {"scale": np.array(0.5, np.float32), "step": np.int32(7),
               "t": np.arange(6, dtype=np.float32).reshape(2, 3).T}
    path = write_safetensors(tensors, tmp_path / "s.safetensors")
    for back in (load_file(str(path)), open_checkpoint(path)):
        for name, want in tensors.items():
            assert back[name].shape == np.shape(want) and (np.asarray(back[name]) == want).all(), name
