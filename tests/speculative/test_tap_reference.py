"""Taps, EAGLE-3 and DFlash against the published conventions, written here as plain float64 numpy
forwards over the checkpoints' own tensors (HF names; tests/speculative/tap_checkpoints.py):

- a tap of layer i is the residual stream after decoder layer i: HF's output_hidden_states[i + 1]
  (what DFlash's target_layer_ids and SGLang's eagle_config ids name; vLLM's top-level EAGLE-3 ids
  name the next layer's input, the same tensor);
- EAGLE-3 row (SafeAILab EAGLE-3 / vLLM llama_eagle3): g = fc(cat taps); attention over
  cat[input_layernorm(embed), hidden_norm(g)] (embedding first, no QK-norm, RoPE at the row's
  position, causal); residual g (hidden_norm(g) with norm_before_residual); MLP; norm; lm_head over
  the draft vocabulary, target id = draft id + d2t;
- DFlash block (z-lab DFlash): context c = hidden_norm(fc(cat taps)) shared by every layer, its K
  through each layer's k_proj and k_norm (no input_layernorm), RoPE at the context positions; the
  block [token, mask ..] queries the context and itself without a causal mask; the target's LM head.

A convention error shared by the engine drafters and their full-sequence forwards (which are only
checked against each other in test_tap_drafters.py) passes those tests; it fails these.
"""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

import jaxspec
from jaxspec.cache import allocate
from jaxspec.models.model import StepBatch, forward
from jaxspec.speculative import dflash, mtp
from jaxspec.speculative.session import SESSIONS
from tests.models.conftest import hf_model
from tests.speculative.tap_checkpoints import write_dflash, write_eagle3
from tests.speculative.test_mtp_reference import rel_rms, rope, silu

PAGE, MAX_LEN = 4, 32
SPANS = ((0, 5), (5, 3))  # (start, length): a prompt-like span, then a span attending to it


def rms(x, w, eps=1e-6):
    """Plain RMSNorm of the drafters: x / rms(x) * w."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def attention(q, k, v, causal: bool):
    """q [T, nH, D], k / v [S, nKV, D] (keys of q row t at S - T + t) -> [T, nH * D]."""
    T, nH, D = q.shape
    kv_head = np.arange(nH) // (nH // k.shape[1])
    scores = np.einsum("thd,shd->hts", q, k[:, kv_head]) / np.sqrt(D)
    if causal:
        S = k.shape[0]
        scores = np.where(np.arange(S)[None, :] <= S - T + np.arange(T)[:, None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("hts,shd->thd", probs, v[:, kv_head]).reshape(T, -1)


def mlp(w, p, x):
    return (silu(x @ w[p + "gate_proj.weight"].T) * (x @ w[p + "up_proj.weight"].T)) @ w[p + "down_proj.weight"].T


def heads_of(x, w, n):
    return (x @ w.T).reshape(x.shape[0], n, -1)


@pytest.fixture(scope="module")
def target(hf_checkpoint):
    path = hf_checkpoint("qwen3_5")
    model = jaxspec.load(path, dtype="float32", kernels="xla", max_model_len=MAX_LEN, max_num_seqs=1,
                         prefill_chunk=8, page_size=PAGE)
    return path, model


def _tensors(directory):
    return {k: v.astype(np.float64) if v.dtype.kind == "f" else v
            for k, v in load_file(str(directory / "model.safetensors")).items()}


def _rows(rng, model, total, width):
    return rng.standard_normal((total, width)).astype(np.float32), rng.integers(0, model.config.vocab_size, total)


def _kv(drafter, model):
    ecfg = model.engine_config()
    kv = [tuple(jnp.zeros(s.shape, s.dtype) for s in pair)
          for pair in mtp.kv_shapes(drafter.cfg, ecfg.total_pages, PAGE, drafter.num_layers, jnp.float32)]
    return kv, jnp.arange(1, 1 + ecfg.pages_per_seq, dtype=jnp.int32)[None]


# ---- taps -------------------------------------------------------------------------------------------

def test_taps_are_the_residual_stream_after_each_layer(target):
    """model.forward(taps=(2, 0, 1)) = HF hidden_states[3], [1], [2] concatenated, in that order."""
    path, model = target
    T, taps = 11, (2, 0, 1)
    ids = np.random.default_rng(1).integers(0, model.config.vocab_size - 3, T)
    with torch.no_grad():
        hs = hf_model(path).model(torch.tensor(ids[None]), output_hidden_states=True).hidden_states
    want = np.concatenate([hs[i + 1][0].numpy() for i in taps], axis=-1)
    ecfg = model.engine_config()
    zero, one = jnp.asarray([0], jnp.int32), jnp.asarray([1], jnp.int32)
    batch = StepBatch(tokens=jnp.asarray(ids[None], jnp.int32), start_pos=zero, num_valid=jnp.asarray([T], jnp.int32),
                      block_tables=jnp.arange(1, 1 + ecfg.pages_per_seq, dtype=jnp.int32)[None], state_read=zero,
                      state_write=one, conv_read=zero, conv_offset=zero, conv_write=one)
    step = jax.jit(functools.partial(forward, mode="prefill", kernels="xla", last_only=False, taps=taps),
                   static_argnums=1)
    _, hidden, _ = step(model.params, model.config, allocate(model.config, ecfg, jnp.float32), batch)
    assert hidden.shape == (1, T, 3 * model.config.hidden_size)
    assert rel_rms(hidden[0], want) < 1e-5


# ---- EAGLE-3 -------------------------------------------------------------------------------------------

def eagle3_reference(w, cfg, taps, next_tokens, embed, positions):
    """The published EAGLE-3 rows (module docstring), causal over the rows. Returns (out [T, H]
    before the final norm, target token ids [T])."""
    m, nH, nKV, theta = "midlayer.", cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["rope_theta"]
    g = taps @ w["fc.weight"].T
    hn = rms(g, w[m + "hidden_norm.weight"])
    x = np.concatenate([rms(embed[next_tokens], w[m + "input_layernorm.weight"]), hn], axis=-1)
    q = rope(heads_of(x, w[m + "self_attn.q_proj.weight"], nH), positions, theta, cfg["head_dim"])
    k = rope(heads_of(x, w[m + "self_attn.k_proj.weight"], nKV), positions, theta, cfg["head_dim"])
    v = heads_of(x, w[m + "self_attn.v_proj.weight"], nKV)
    h = (hn if cfg.get("norm_before_residual") else g) + attention(q, k, v, True) @ w[m + "self_attn.o_proj.weight"].T
    out = h + mlp(w, m + "mlp.", rms(h, w[m + "post_attention_layernorm.weight"]))
    logits = rms(out, w["norm.weight"]) @ w["lm_head.weight"].T
    draft = np.argmax(logits, -1)
    return out, draft + w["d2t"][draft]


@pytest.mark.parametrize("ids_key,before", [("eagle_config", False), ("top", True)])
def test_eagle3_rows_match_the_published_architecture(target, tmp_path, ids_key, before):
    """Two spans of one request through the engine row (paged KV): out and the mapped draft ids equal
    the reference; both ways of naming the tap ids give the same taps."""
    _, model = target
    H, V = model.config.hidden_size, model.config.vocab_size
    path = write_eagle3(tmp_path, hidden=H, vocab=V, draft_vocab=V - 40, layer_ids=(0, 3, 1), ids_key=ids_key,
                        norm_before_residual=before)
    head = jaxspec.SpeculativeConfig("eagle3", 2, draft_model=path).draft_model
    assert head.config.taps(model.config) == (0, 3, 1)
    cfg, w = json.loads((path / "config.json").read_text()), _tensors(path)
    drafter = SESSIONS["eagle3"].make_drafter(model, model.engine_config(), 2, draft_model=head)
    dparams = SESSIONS["eagle3"].module.draft_params(head, model.params, jnp.float32)
    rng = np.random.default_rng(0)
    total = sum(n for _, n in SPANS)
    taps, tokens = _rows(rng, model, total, 3 * H)
    embed = np.asarray(model.params["embed"], np.float64)
    want_out, want_ids = eagle3_reference(w, cfg, taps.astype(np.float64), tokens, embed, np.arange(total, dtype=float))
    kv, tables = _kv(drafter, model)
    run = jax.jit(drafter.rows)
    for start, n in SPANS:
        rows = slice(start, start + n)
        out, logits, kv = run(dparams, kv, jnp.asarray(taps[None, rows]), jnp.asarray(tokens[None, rows], jnp.int32),
                              jnp.asarray([start], jnp.int32), jnp.asarray([n], jnp.int32), tables)
        assert rel_rms(out[0], want_out[rows]) < 1e-5, (start, rel_rms(out[0], want_out[rows]))
        assert (np.asarray(drafter.token(dparams, logits[0])) == want_ids[rows]).all()


# ---- DFlash -------------------------------------------------------------------------------------------

def dflash_reference(w, cfg, lm_head, embed, taps, token, P):
    """The published DFlash block [token, mask ..] at position P over context 0 .. P - 1 (taps
    [P, n H]). Returns float64 logits [T - 1, V] of the block's rows 1 ..."""
    dc, nH, nKV = cfg["dflash_config"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    theta, D = cfg["rope_theta"], cfg["head_dim"]
    T = dc["block_size"]
    c = rms(taps @ w["fc.weight"].T, w["hidden_norm.weight"])
    x = embed[[token] + [dc["mask_token_id"]] * (T - 1)]
    ctx_pos, blk_pos = np.arange(P, dtype=float), P + np.arange(T, dtype=float)
    for i in range(cfg["num_hidden_layers"]):
        a = f"layers.{i}.self_attn."
        h = rms(x, w[f"layers.{i}.input_layernorm.weight"])

        def keys(y, pos, a=a):  # the context's keys skip input_layernorm: k_proj reads c directly
            return rope(rms(heads_of(y, w[a + "k_proj.weight"], nKV), w[a + "k_norm.weight"]), pos, theta, D)

        q = rope(rms(heads_of(h, w[a + "q_proj.weight"], nH), w[a + "q_norm.weight"]), blk_pos, theta, D)
        k = np.concatenate([keys(c, ctx_pos), keys(h, blk_pos)])
        v = np.concatenate([heads_of(c, w[a + "v_proj.weight"], nKV), heads_of(h, w[a + "v_proj.weight"], nKV)])
        x = x + attention(q, k, v, False) @ w[a + "o_proj.weight"].T
        x = x + mlp(w, f"layers.{i}.mlp.", rms(x, w[f"layers.{i}.post_attention_layernorm.weight"]))
    return rms(x, w["norm.weight"])[1:] @ lm_head


def test_dflash_block_matches_the_published_architecture(target, tmp_path):
    """Context written in two spans through the engine drafter (paged KV), then one block: its logits
    equal the reference; so do the dense training forward's."""
    _, model = target
    H, V = model.config.hidden_size, model.config.vocab_size
    path = write_dflash(tmp_path, hidden=H, vocab=V, target_layer_ids=(3, 0, 2), mask_token_id=V - 5, block_size=4)
    head = jaxspec.SpeculativeConfig("dflash", 3, draft_model=path).draft_model
    cfg, w = json.loads((path / "config.json").read_text()), _tensors(path)
    drafter = SESSIONS["dflash"].make_drafter(model, model.engine_config(), 3, draft_model=head)
    dparams = dflash.draft_params(head, model.params, jnp.float32)
    rng = np.random.default_rng(0)
    P = sum(n for _, n in SPANS)
    taps, _ = _rows(rng, model, P, 3 * H)
    token = 7
    lm_head, embed = (np.asarray(model.params[n], np.float64) for n in ("lm_head", "embed"))
    want = dflash_reference(w, cfg, lm_head, embed, taps.astype(np.float64), token, P)
    kv, tables = _kv(drafter, model)
    for start, n in SPANS:
        kv = jax.jit(drafter._write_context)(dparams, kv, jnp.asarray(taps[None, start:start + n]),
                                             jnp.asarray([start], jnp.int32), jnp.asarray([n], jnp.int32), tables)
    got, _ = jax.jit(drafter.block_logits)(dparams, kv, jnp.asarray([token], jnp.int32), jnp.asarray([P], jnp.int32),
                                           jnp.asarray([True]), tables)
    assert rel_rms(got[0], want) < 1e-5, rel_rms(got[0], want)
    ids = np.asarray([[token] + [V - 5] * 3], np.int32)
    dense = jax.jit(dflash.train_block_logits, static_argnums=(1, 2))(
        dparams, head.config, False, jnp.asarray(np.pad(taps, ((0, 3), (0, 0)))[None]), jnp.asarray([P], jnp.int32),
        jnp.asarray(ids), jnp.asarray([P], jnp.int32))
    assert rel_rms(dense[0, 1:], want) < 1e-5, rel_rms(dense[0, 1:], want)


# ---- the published layouts' refusals ---------------------------------------------------------------

def test_unsupported_variants_are_refused_naming_the_field(target, tmp_path):
    _, model = target
    H, V = model.config.hidden_size, model.config.vocab_size
    cases = [
        ("dflash", write_dflash(tmp_path / "cap", hidden=H, vocab=V,
                                dflash_overrides={"final_logit_softcapping": 20.0}),
         "dflash_config.final_logit_softcapping=20.0 is not supported"),
        ("dflash", write_dflash(tmp_path / "mask", hidden=H, vocab=V, mask_token_id=V), "mask_token_id=160 must be"),
        ("eagle3", write_eagle3(tmp_path / "two", hidden=H, vocab=V, draft_vocab=V, overrides={"num_hidden_layers": 2}),
         "num_hidden_layers=2: a head has one draft decoder layer"),
        ("eagle3", write_eagle3(tmp_path / "ids", hidden=H, vocab=V, draft_vocab=V, layer_ids=(0, 1)),
         r"eagle_aux_hidden_state_layer_ids has 2 ids but fc.weight reads 3 taps"),
    ]
    for method, path, message in cases:
        with pytest.raises(ValueError, match=message):
            jaxspec.SpeculativeConfig(method, 2, draft_model=path)
    from safetensors.numpy import save_file

    bad = write_eagle3(tmp_path / "d2t", hidden=H, vocab=V, draft_vocab=V - 40)
    tensors = load_file(str(bad / "model.safetensors"))
    tensors["d2t"] = tensors["d2t"] + 50  # maps the last draft ids past the vocabulary
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match=r"d2t maps draft ids to target ids .* outside the vocabulary 0..159"):
        jaxspec.SpeculativeConfig("eagle3", 2, draft_model=bad)
