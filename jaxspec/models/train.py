"""Full-sequence forward for training (no paged caches), over the params layout of
docs/architecture.md, so that trained params load straight into jaxspec.

Same math as `model.forward` with the engine's caches replaced by a whole sequence: dense causal
attention instead of paged attention, and for GDN the reference `causal_conv1d` (zero start window)
and the reference `chunk_gated_delta` from a zero state (its T = (I + A)^-1 comes from block-doubling
matmuls, not a LAPACK triangular solve, which deadlocks on the CPU when a backward pass runs two at
once: `reference.unit_lower_inverse`).
tests/test_train_forward.py checks the logits against `jaxspec.score`. Also the MTP head
(docs/model_math.md#mtp-head) for joint training.

Shapes: B sequences, T tokens, H hidden, V vocab. Differentiable; nothing here jits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.config import FULL, ModelConfig
from jaxspec.models import layers
from jaxspec.models.model import logits_from_hidden
from pallas_kernels.gated_delta import reference as gdn_ref
from pallas_kernels.gated_delta.reference import causal_conv1d, l2norm

F32 = jnp.float32
MASK_VALUE = -1e30
GDN_CHUNK = 64  # the chunk size of the engine's prefill path


def chunk_gated_delta(q, k, v, g, beta, *, chunk_size: int = GDN_CHUNK):
    """The reference `chunk_gated_delta` from a zero state. q, k [B, T, HK, dk] (normalised, q
    scaled); v [B, T, HV, dv]; g, beta [B, T, HV] -> o [B, T, HV, dv] f32."""
    B, _, HV, dv = v.shape
    h0 = jnp.zeros((B, HV, q.shape[-1], dv), F32)
    return gdn_ref.chunk_gated_delta(q, k, v, g, beta, h0, chunk_size=chunk_size)[0]


def causal_attention(p, cfg: ModelConfig, x, positions):
    """(Gated) GQA attention over the whole sequence, causal. x [B, T, H], positions [B, T] int32."""
    B, T, _ = x.shape
    nH, nKV, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q = layers.linear(x, p["q"], p.get("q_bias"))
    gate = None
    if cfg.attn_output_gate:  # q_proj columns per head: [q_h | gate_h]
        q, gate = jnp.split(q.reshape(B, T, nH, 2 * D), 2, axis=-1)
        gate = gate.reshape(B, T, nH * D)
    q = q.reshape(B, T, nH, D)
    k = layers.linear(x, p["k"], p.get("k_bias")).reshape(B, T, nKV, D)
    v = layers.linear(x, p["v"], p.get("v_bias")).reshape(B, T, nKV, D)
    if "q_norm" in p:  # as layers.attention: the EAGLE-3 draft layer has no QK-norm
        q = layers.rms_norm(q, p["q_norm"], cfg.rms_norm_eps, cfg.zero_centered_norm)
        k = layers.rms_norm(k, p["k_norm"], cfg.rms_norm_eps, cfg.zero_centered_norm)
    q = layers.rope(q, positions, cfg.rope_theta, cfg.rotary_dim)
    k = layers.rope(k, positions, cfg.rope_theta, cfg.rotary_dim)
    qg = q.reshape(B, T, nKV, nH // nKV, D)  # query head h reads kv head h // (nH // nKV)
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=F32) * D ** -0.5  # [B, nKV, G, T, T]
    causal = jnp.tril(jnp.ones((T, T), bool))
    probs = jax.nn.softmax(jnp.where(causal, s, MASK_VALUE), axis=-1)
    o = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v.dtype), v).reshape(B, T, nH * D)
    if gate is not None:
        o = o * jax.nn.sigmoid(gate)
    return layers.linear(o, p["o"], p.get("o_bias"))


def gated_delta_net(p, cfg: ModelConfig, x):
    """Gated DeltaNet mixer, whole sequence, zero start state (docs/model_math.md#gated-deltanet). x [B, T, H]."""
    B, T, _ = x.shape
    HV, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    K = cfg.linear_conv_kernel_dim
    mixed = x @ p["qkv"]  # [B, T, conv_dim], channels grouped per key head (layers.split_qkv)
    z = (x @ p["z"]).reshape(B, T, HV, dv)
    b = x @ p["b"]  # [B, T, HV]
    a = x @ p["a"]
    mixed, _ = causal_conv1d(mixed, p["conv"], jnp.zeros((B, K - 1, mixed.shape[-1]), mixed.dtype))
    q, k, v = layers.split_qkv(mixed, cfg)
    q = l2norm(q) * dk ** -0.5
    k = l2norm(k)
    beta = jax.nn.sigmoid(b).astype(F32)
    g = -jnp.exp(p["A_log"].astype(F32)) * jax.nn.softplus(a.astype(F32) + p["dt_bias"].astype(F32))
    o = chunk_gated_delta(q, k, v, g, beta)  # [B, T, HV, dv] f32
    o = layers.rms_norm_gated(o.astype(x.dtype), z, p["norm"], cfg.rms_norm_eps).reshape(B, T, HV * dv)
    return o @ p["out"]


def decoder_layer(layer, cfg: ModelConfig, mixer: str, x, positions):
    """One pre-norm decoder layer; mixer is config.FULL or config.LINEAR. x [B, T, H]."""
    eps, zc = cfg.rms_norm_eps, cfg.zero_centered_norm
    h = layers.rms_norm(x, layer["input_norm"], eps, zc)
    h = causal_attention(layer["attn"], cfg, h, positions) if mixer == FULL else gated_delta_net(layer["gdn"], cfg, h)
    x = x + h
    h = layers.rms_norm(x, layer["post_norm"], eps, zc)
    return x + layers.feed_forward(layer, cfg, h)


def forward_hidden(params, cfg: ModelConfig, tokens, taps: tuple[int, ...] = ()):
    """tokens [B, T] int32 -> hidden [B, T, H] after the final norm (what `model.forward` returns
    as the MTP input), or with taps the residual stream after each listed layer, concatenated
    [B, T, len(taps) * H] (the EAGLE-3 / DFlash input, as `model.forward(taps=...)`). The
    parameter dtype is the compute dtype."""
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    x = params["embed"][tokens]
    tapped = {}
    for i, layer in enumerate(params["layers"][:max(taps) + 1] if taps else params["layers"]):
        x = decoder_layer(layer, cfg, cfg.layer_types[i], x, positions)
        tapped[i] = x
    if taps:
        return jnp.concatenate([tapped[i] for i in taps], axis=-1)
    return layers.rms_norm(x, params["norm"], cfg.rms_norm_eps, cfg.zero_centered_norm)


def forward(params, cfg: ModelConfig, tokens):
    """tokens [B, T] -> (float32 logits [B, T, V], hidden [B, T, H]); position t predicts token t+1."""
    hidden = forward_hidden(params, cfg, tokens)
    return logits_from_hidden(params, cfg, hidden), hidden


def mtp_hidden(params, cfg: ModelConfig, hidden, next_tokens):
    """MTP head (docs/model_math.md#mtp-head). hidden [B, T, H] from forward_hidden; next_tokens [B, T]
    with next_tokens[:, t] = token t+1. Row t: fc(cat[norm_e(embed(token t+1)), norm_h(hidden_t)])
    -> the MTP decoder layers (causal over rows, RoPE position t+1, the position of the embedded
    token) -> mtp.norm. Returns [B, T, H]; its logits (shared lm_head) predict token t+2."""
    mtp, eps, zc = params["mtp"], cfg.rms_norm_eps, cfg.zero_centered_norm
    B, T = next_tokens.shape
    e = layers.rms_norm(params["embed"][next_tokens], mtp["pre_fc_norm_embedding"], eps, zc)
    h = layers.rms_norm(hidden, mtp["pre_fc_norm_hidden"], eps, zc)
    x = jnp.concatenate([e, h], axis=-1) @ mtp["fc"]  # [B, T, 2H] @ [2H, H]
    positions = jnp.broadcast_to(jnp.arange(1, T + 1, dtype=jnp.int32), (B, T))
    for layer in mtp["layers"]:
        x = decoder_layer(layer, cfg, FULL, x, positions)
    return layers.rms_norm(x, mtp["norm"], eps, zc)


def mtp_logits(params, cfg: ModelConfig, hidden, next_tokens):
    """float32 logits [B, T, V] of the MTP head; row t predicts token t+2."""
    return logits_from_hidden(params, cfg, mtp_hidden(params, cfg, hidden, next_tokens))
