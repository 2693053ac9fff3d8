"""Training-side pieces of the tap drafters and the MTP head, on tiny random heads:

- eagle3.save / dflash.save write the published layouts that eagle3.load / dflash.load read back
  exactly (float32 and bfloat16), and a head's own embedding loads as the [V, H] table it is stored as;
- the training-time-test chains (eagle3.train_chain, train.mtp_chain_hidden) equal the engine's chain
  drafting recomputed row by row on a growing sequence (exact rows, then recursive rows that read the
  previous row's output and token), the oracle tests/speculative/test_tap_drafters.py checks against
  the engine.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxspec import demo
from jaxspec.models import train
from jaxspec.speculative import dflash, eagle3, heads
from jaxspec.weights import read_checkpoint_tensors
from tests.speculative.tap_checkpoints import write_dflash, write_eagle3

H, V = 32, 24
STEPS, T = 3, 9


def _leaves_equal(a, b) -> None:
    paths = jax.tree_util.tree_leaves_with_path(a)
    for (path, x), y in zip(paths, jax.tree_util.tree_leaves(b), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y), jax.tree_util.keystr(path)


def _bf16(head):
    return jax.tree_util.tree_map(lambda x: x if x.dtype.kind in "iub" else x.astype(ml_dtypes.bfloat16), head.params)


@pytest.mark.parametrize("bf16", [False, True])
def test_eagle3_save_load_round_trip(tmp_path, bf16):
    src = write_eagle3(tmp_path / "src", hidden=H, vocab=V, draft_vocab=V - 5, layer_ids=(0, 2, 3), own_embed=True,
                       norm_before_residual=True)
    head = eagle3.load(src)
    stored = read_checkpoint_tensors(src)["embed_tokens.weight"]
    assert np.array_equal(head.params["embed"], stored)  # [V, H], the table the rows index
    params = _bf16(head) if bf16 else head.params
    eagle3.save(params, head.config, tmp_path / "out")
    back = eagle3.load(tmp_path / "out")
    assert back.config == head.config
    _leaves_equal(params, back.params)
    written = read_checkpoint_tensors(tmp_path / "out")
    assert written["d2t"].dtype == np.int64 and written["t2d"].sum() == V - 5
    assert np.array_equal(np.flatnonzero(written["t2d"]), np.arange(V - 5) + written["d2t"])


@pytest.mark.parametrize("bf16", [False, True])
def test_dflash_save_load_round_trip(tmp_path, bf16):
    head = dflash.load(write_dflash(tmp_path / "src", hidden=H, vocab=V, target_layer_ids=(0, 2, 3), mask_token_id=7,
                                    block_size=16, num_layers=2))
    params = _bf16(head) if bf16 else head.params
    dflash.save(params, head.config, tmp_path / "out")
    back = dflash.load(tmp_path / "out")
    assert back.config == head.config
    _leaves_equal(params, back.params)


def test_layer_config_json_reads_back_every_field():
    """The draft layers' config.json (written by save) reads back to the same ModelConfig, including
    fields away from their defaults."""
    cfg = heads.layer_config({"hidden_size": H, "num_hidden_layers": 2, "num_attention_heads": 4,
                              "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 64, "vocab_size": V,
                              "rms_norm_eps": 1e-5, "rope_theta": 5e5, "partial_rotary_factor": 0.5,
                              "max_position_embeddings": 2048})
    assert cfg.max_position_embeddings == 2048 and cfg.partial_rotary_factor == 0.5
    assert heads.layer_config(heads.layer_config_json(cfg)) == cfg


def test_save_refuses_mixed_float_dtypes(tmp_path):
    head = dflash.load(write_dflash(tmp_path / "src", hidden=H, vocab=V))
    params = {**head.params, "norm": head.params["norm"].astype(ml_dtypes.bfloat16)}
    with pytest.raises(ValueError, match="float dtypes .* pass dtype="):
        dflash.save(params, head.config, tmp_path / "out")
    dflash.save(params, head.config, tmp_path / "out", dtype="float32")
    assert dflash.load(tmp_path / "out").params["norm"].dtype == np.float32


def _growing(rows, first, tokens, m: int, j: int):
    """Draft j + 1 of the chain after the exact rows 0 .. m, recomputed as the engine runs it: rows(x
    [1, T, H], tokens [1, T]) -> (out, logits), causal, so rows past the filled ones change nothing;
    row m + i (i = 1 .. j) reads the previous row's output and token m + i. Returns row m + j's logits."""
    x = np.array(first)
    x[:, m + 1:] = 0
    for i in range(1, j + 1):
        out, _ = rows(jnp.asarray(x), tokens)
        x[:, m + i] = out[:, m + i - 1]
    return rows(jnp.asarray(x), tokens)[1][:, m + j]


def test_eagle3_train_chain_equals_chain_drafting(tmp_path):
    head = eagle3.load(write_eagle3(tmp_path / "h", hidden=H, vocab=V, draft_vocab=V - 3, layer_ids=(0, 1, 2)))
    hp, cfg = head.params, head.config
    rng = np.random.default_rng(0)
    embed = jnp.asarray(rng.standard_normal((V, H)), jnp.float32)
    g = eagle3.fuse(hp, jnp.asarray(rng.standard_normal((1, T, 3 * H)), jnp.float32))
    tokens = jnp.asarray(rng.integers(0, V, (1, T)), jnp.int32)
    _, chain = jax.jit(lambda g: eagle3.train_chain(hp, cfg, embed, g, tokens, STEPS))(g)

    rows = jax.jit(lambda x, tok: eagle3.train_rows(hp, cfg, embed, x, tok))
    for j in range(STEPS):
        for m in (0, T - 1 - j):
            want = _growing(rows, g, tokens, m, j)
            np.testing.assert_allclose(chain[j][:, m + j], want, rtol=1e-5, atol=1e-5)


def test_mtp_chain_equals_chain_drafting():
    cfg = demo.demo_config("qwen3_5")
    rng = np.random.default_rng(1)
    Hm = cfg.hidden_size
    params = demo.init_params(cfg, seed=3)
    layer = demo.init_layer(jax.random.PRNGKey(4), cfg, cfg.attention_layers[0], jnp.float32)
    params["mtp"] = {"fc": jnp.asarray(rng.standard_normal((2 * Hm, Hm)) / np.sqrt(2 * Hm), jnp.float32),
                     "layers": [layer], **{k: jnp.asarray(0.1 * rng.standard_normal(Hm), jnp.float32)
                                           for k in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}}
    hidden = jnp.asarray(rng.standard_normal((1, T, Hm)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, T)), jnp.int32)
    chain = jax.jit(lambda h: train.mtp_chain_hidden(params, cfg, h, tokens, STEPS))(hidden)

    rows = jax.jit(lambda x, tok: (train.mtp_hidden(params, cfg, x, tok),) * 2)
    for j in range(STEPS):
        for m in (0, T - 1 - j):
            want = _growing(rows, hidden, tokens, m, j)
            np.testing.assert_allclose(chain[j][:, m + j], want, rtol=1e-5, atol=1e-5)
