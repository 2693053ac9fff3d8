"""The MTP head against the published Qwen3-Next / Qwen3.5 MTP architecture, written here as a plain
float64 numpy forward over the checkpoint's own tensors (HF names), on random mtp.* weights.

The published layout (the mtp.* tensors of Qwen3-Next / Qwen3.5 checkpoints, as serving engines load
them): row t reads the target's hidden state h_t and the embedding of token t + 1;
x = mtp.fc(cat[pre_fc_norm_embedding(embed(token_{t+1})), pre_fc_norm_hidden(h_t)]) (embedding first,
fc: Linear(2H -> H, no bias), both norms zero-centred RMSNorm (1 + w)); then the mtp.layers.N.*
decoder layer(s): a full-attention layer of the family (output-gated attention, q / k RMSNorm,
partial RoPE at the row's position, the position of h_t, causal over the rows; dense MLP or MoE
with a gated shared expert); then mtp.norm; the target's lm_head gives the logits of token t + 2.
h_t is the target model's output hidden state, after its final norm (what the model returns as its
last hidden state). A convention error shared by jaxspec's MTP drafter and its training forward
(concatenation order, which norm applies to which input, pre- or post-norm hidden, the RoPE
position) passes the trained-demo tests; it fails these.
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
from jaxspec.speculative.mtp import draft_params, kv_shapes, mtp_forward
from tests.models.conftest import hf_model

PAGE, MAX_LEN = 4, 32
SPANS = ((0, 5), (5, 3))  # (start, length): a prompt-like span, then a span attending to it


def rms_norm(x, w, eps):
    """Zero-centred RMSNorm of these families: x / rms(x) * (1 + w)."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (1.0 + w)


def silu(x):
    return x / (1.0 + np.exp(-x))


def rope(x, positions, theta, rotary_dim):
    """NeoX rotate-half RoPE on the first rotary_dim dims. x [T, n, D], positions [T]."""
    inv_freq = 1.0 / theta ** (np.arange(0, rotary_dim, 2) / rotary_dim)
    angles = positions[:, None] * inv_freq  # [T, rot/2]
    cos, sin = np.cos(angles)[:, None], np.sin(angles)[:, None]  # [T, 1, rot/2]
    a, b = x[..., :rotary_dim // 2], x[..., rotary_dim // 2:rotary_dim]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin, x[..., rotary_dim:]], axis=-1)


def attention(w, p, x, positions, cfg):
    """Output-gated GQA attention, causal over the rows. x [T, H]; w = checkpoint tensors; p = prefix."""
    T = x.shape[0]
    nH, nKV, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    rope_cfg = cfg["rope_parameters"]
    q, gate = np.split((x @ w[p + "q_proj.weight"].T).reshape(T, nH, 2 * D), 2, axis=-1)  # per head [q | gate]
    k = (x @ w[p + "k_proj.weight"].T).reshape(T, nKV, D)
    v = (x @ w[p + "v_proj.weight"].T).reshape(T, nKV, D)
    eps = cfg["rms_norm_eps"]
    q, k = rms_norm(q, w[p + "q_norm.weight"], eps), rms_norm(k, w[p + "k_norm.weight"], eps)
    rot = int(D * rope_cfg["partial_rotary_factor"])
    q, k = rope(q, positions, rope_cfg["rope_theta"], rot), rope(k, positions, rope_cfg["rope_theta"], rot)
    kv_head = np.arange(nH) // (nH // nKV)
    scores = np.einsum("thd,shd->hts", q, k[:, kv_head]) / np.sqrt(D)  # [nH, T, T]
    scores = np.where(np.tril(np.ones((T, T), bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    o = np.einsum("hts,shd->thd", probs, v[:, kv_head])
    o = o * (1.0 / (1.0 + np.exp(-gate)))
    return o.reshape(T, nH * D) @ w[p + "o_proj.weight"].T


def mlp(w, p, x):
    return (silu(x @ w[p + "gate_proj.weight"].T) * (x @ w[p + "up_proj.weight"].T)) @ w[p + "down_proj.weight"].T


def feed_forward(w, p, x, cfg):
    """Dense SwiGLU MLP, or the MoE: softmax router, top-k (renormalised when norm_topk_prob), plus a
    sigmoid-gated shared expert."""
    if "num_experts" not in cfg:
        return mlp(w, p + "mlp.", x)
    logits = x @ w[p + "mlp.gate.weight"].T  # [T, E]
    router = np.exp(logits - logits.max(-1, keepdims=True))
    router /= router.sum(-1, keepdims=True)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        top = np.argsort(-router[t], kind="stable")[:cfg["num_experts_per_tok"]]
        weights = router[t, top] / (router[t, top].sum() if cfg.get("norm_topk_prob") else 1.0)
        for e, we in zip(top, weights, strict=True):
            out[t] += we * mlp(w, f"{p}mlp.experts.{e}.", x[t:t + 1])[0]
    shared_gate = 1.0 / (1.0 + np.exp(-(x @ w[p + "mlp.shared_expert_gate.weight"].T)))  # [T, 1]
    return out + shared_gate * mlp(w, p + "mlp.shared_expert.", x)


def mtp_reference(w, cfg, hidden, next_tokens, positions):
    """The published MTP forward over rows t: hidden [T, H] (target, after its final norm), next_tokens
    [T] (token t + 1), positions [T] (the position of hidden_t). Returns (mtp hidden [T, H], logits [T, V])."""
    eps = cfg["rms_norm_eps"]
    e = rms_norm(w["model.embed_tokens.weight"][next_tokens], w["mtp.pre_fc_norm_embedding.weight"], eps)
    h = rms_norm(hidden, w["mtp.pre_fc_norm_hidden.weight"], eps)
    x = np.concatenate([e, h], axis=-1) @ w["mtp.fc.weight"].T  # embedding first
    for n in range(cfg["mtp_num_hidden_layers"]):
        p = f"mtp.layers.{n}."
        x = x + attention(w, p + "self_attn.", rms_norm(x, w[p + "input_layernorm.weight"], eps), positions, cfg)
        x = x + feed_forward(w, p, rms_norm(x, w[p + "post_attention_layernorm.weight"], eps), cfg)
    out = rms_norm(x, w["mtp.norm.weight"], eps)
    return out, out @ w["lm_head.weight"].T


def rel_rms(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b ** 2)))


@pytest.fixture(params=["qwen3_5", "qwen3_next"], scope="module")
def mtp_checkpoint(request, hf_checkpoint):
    """(jaxspec model, HF text config, float64 checkpoint tensors by HF name, checkpoint path)."""
    path = hf_checkpoint(request.param, mtp=True)
    model = jaxspec.load(path, dtype="float32", kernels="xla", max_model_len=MAX_LEN, max_num_seqs=1,
                         prefill_chunk=8, page_size=PAGE)
    config = json.loads((path / "config.json").read_text())
    tensors = {k: v.astype(np.float64) for k, v in load_file(str(path / "model.safetensors")).items()}
    return model, config.get("text_config", config), tensors, path


def test_mtp_forward_matches_the_published_architecture(mtp_checkpoint):
    """Two spans of one request (the second attends to the first through the MTP KV pages): hidden
    states and logits equal the float64 reference at positions 0..7."""
    model, cfg, w, _ = mtp_checkpoint
    rng = np.random.default_rng(0)
    total = sum(n for _, n in SPANS)
    hidden = rng.standard_normal((total, cfg["hidden_size"])).astype(np.float32)
    tokens = rng.integers(0, cfg["vocab_size"], total)
    want_h, want_logits = mtp_reference(w, cfg, hidden.astype(np.float64), tokens, np.arange(total, dtype=np.float64))
    ecfg = model.engine_config()
    kv = [tuple(jnp.zeros(s.shape, s.dtype) for s in pair)
          for pair in kv_shapes(model.config, ecfg.total_pages, PAGE, cfg["mtp_num_hidden_layers"], jnp.float32)]
    tables = jnp.arange(1, 1 + ecfg.pages_per_seq, dtype=jnp.int32)[None]  # [1, P]
    run = jax.jit(functools.partial(mtp_forward, kernels="xla"), static_argnums=1)
    for start, n in SPANS:
        rows = slice(start, start + n)
        got_h, got_logits, kv = run(draft_params(model.params), model.config, kv, jnp.asarray(hidden[None, rows]),
                                    jnp.asarray(tokens[None, rows], jnp.int32), jnp.asarray([start], jnp.int32),
                                    jnp.asarray([n], jnp.int32), tables)
        assert rel_rms(got_h[0], want_h[rows]) < 1e-5, (start, rel_rms(got_h[0], want_h[rows]))
        assert rel_rms(got_logits[0], want_logits[rows]) < 1e-5, (start, rel_rms(got_logits[0], want_logits[rows]))
        assert (np.argmax(got_logits[0], -1) == np.argmax(want_logits[rows], -1)).all()


def test_the_mtp_input_is_the_hidden_state_after_the_final_norm(mtp_checkpoint):
    """model.forward's hidden output (what the engine hands the MTP head) is the target's last hidden
    state after its final norm, as the HF model returns it."""
    model, cfg, _, path = mtp_checkpoint
    T = 11
    ids = np.random.default_rng(1).integers(0, cfg["vocab_size"] - 3, T)
    hf = hf_model(path)
    with torch.no_grad():
        want = hf.model(torch.tensor(ids[None])).last_hidden_state[0].numpy()
    ecfg = model.engine_config()
    caches = allocate(model.config, ecfg, jnp.float32)
    one = jnp.asarray([1], jnp.int32)
    zero = jnp.asarray([0], jnp.int32)
    batch = StepBatch(tokens=jnp.asarray(ids[None], jnp.int32), start_pos=zero, num_valid=jnp.asarray([T], jnp.int32),
                      block_tables=jnp.arange(1, 1 + ecfg.pages_per_seq, dtype=jnp.int32)[None], state_read=zero,
                      state_write=one, conv_read=zero, conv_offset=zero, conv_write=one)
    step = jax.jit(functools.partial(forward, mode="prefill", kernels="xla", last_only=False), static_argnums=1)
    _, hidden, _ = step(model.params, model.config, caches, batch)
    assert rel_rms(hidden[0], want) < 1e-5
