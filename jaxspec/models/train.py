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
from jaxspec.models import layers, packing
from jaxspec.models.model import logits_from_hidden
from pallas_kernels.gated_delta import reference as gdn_ref
from pallas_kernels.gated_delta.reference import causal_conv1d

F32 = jnp.float32
MASK_VALUE = -1e30
GDN_CHUNK = 64  # the chunk size of the engine's prefill path


def chunk_gated_delta(q, k, v, g, beta, *, chunk_size: int = GDN_CHUNK):
    """The reference `chunk_gated_delta` from a zero state. q, k [B, T, HK, dk] (normalised, q
    scaled); v [B, T, HV, dv]; g, beta [B, T, HV] -> o [B, T, HV, dv] f32."""
    B, _, HV, dv = v.shape
    h0 = jnp.zeros((B, HV, q.shape[-1], dv), F32)
    return gdn_ref.chunk_gated_delta(q, k, v, g, beta, h0, chunk_size=chunk_size)[0]


def _qkv(p, cfg: ModelConfig, x, positions):
    """Roped q [B, T, nH, D], k, v [B, T, nKV, D] and the output gate [B, T, nH*D] (or None) of x
    [B, T, H_in] (H_in = 2H for the EAGLE-3 layer); QK-norm where the layer has it."""
    B, T, _ = x.shape
    nH, nKV, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q, k, v = packing.project_attention(p, cfg, x)
    gate = None
    if cfg.attn_output_gate:  # q_proj columns per head: [q_h | gate_h]
        q, gate = jnp.split(q.reshape(B, T, nH, 2 * D), 2, axis=-1)
        gate = gate.reshape(B, T, nH * D)
    q = q.reshape(B, T, nH, D)
    k, v = k.reshape(B, T, nKV, D), v.reshape(B, T, nKV, D)
    if "q_norm" in p:  # as layers.attention: the EAGLE-3 draft layer has no QK-norm
        q = layers.rms_norm(q, p["q_norm"], cfg.rms_norm_eps, cfg.zero_centered_norm)
        k = layers.rms_norm(k, p["k_norm"], cfg.rms_norm_eps, cfg.zero_centered_norm)
    q = layers.rope(q, positions, cfg.rope_theta, cfg.rotary_dim)
    k = layers.rope(k, positions, cfg.rope_theta, cfg.rotary_dim)
    return q, k, v, gate


def _attend(p, cfg: ModelConfig, q, k, v, mask, gate):
    """q [B, T, nH, D] over keys / values k, v [B, S, nKV, D] where mask [T, S] (bool) -> [B, T, H]."""
    B, T, nH, D = q.shape
    nKV = k.shape[2]
    qg = q.reshape(B, T, nKV, nH // nKV, D)  # query head h reads kv head h // (nH // nKV)
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=F32) * D ** -0.5  # [B, nKV, G, T, S]
    probs = jax.nn.softmax(jnp.where(mask, s, MASK_VALUE), axis=-1)
    o = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v.dtype), v).reshape(B, T, nH * D)
    if gate is not None:
        o = o * jax.nn.sigmoid(gate)
    return layers.linear(o, p["o"], p.get("o_bias"))


def chain_mask(T: int, depth: int):
    """[T, (depth + 1) T] bool: the keys row t of chain pass `depth` sees, over the keys of passes 0 ..
    depth side by side. A chain drafter (the MTP head at k > 1, EAGLE-3) caches its exact rows
    (pass 0) and then its recursive rows at the following positions, so the row at t of pass j (the
    j-th recursive step of the chain whose last exact row is t - j) sees the exact rows 0 .. t - j
    and the pass-i row at t - j + i for i = 1 .. j (its own chain, itself last)."""
    t, s = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
    return jnp.concatenate([s <= t - depth] + [s == t - depth + i for i in range(1, depth + 1)], axis=1)


def chain_attention(p, cfg: ModelConfig, x, positions, past=()):
    """(Gated) GQA attention of the rows of chain pass len(past) (chain_mask) over x [B, T, H_in] at
    positions [B, T]; past: the (k, v) of passes 0 .. len(past) - 1. With no past, causal attention.
    Returns (out [B, T, H], this pass's (k, v))."""
    q, k, v, gate = _qkv(p, cfg, x, positions)
    keys = jnp.concatenate([pk for pk, _ in past] + [k], axis=1)
    values = jnp.concatenate([pv for _, pv in past] + [v], axis=1)
    return _attend(p, cfg, q, keys, values, chain_mask(x.shape[1], len(past)), gate), (k, v)


def causal_attention(p, cfg: ModelConfig, x, positions):
    """(Gated) GQA attention over the whole sequence, causal. x [B, T, H], positions [B, T] int32."""
    return chain_attention(p, cfg, x, positions)[0]


def gated_delta_net(p, cfg: ModelConfig, x):
    """Gated DeltaNet mixer, whole sequence, zero start state (docs/model_math.md#gated-deltanet). x [B, T, H]."""
    B, T, _ = x.shape
    HV, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    K = cfg.linear_conv_kernel_dim
    mixed, z, b, a = packing.project(p, cfg, x)  # mixed [B, T, conv_dim] grouped per key head; b, a [B, T, HV]
    z = z.reshape(B, T, HV, dv)
    mixed, _ = causal_conv1d(mixed, p["conv"], jnp.zeros((B, K - 1, mixed.shape[-1]), mixed.dtype))
    o = chunk_gated_delta(*gdn_ref.gdn_inputs(mixed, a, b, p["A_log"], p["dt_bias"], dk=dk, dv=dv))  # f32
    o = layers.rms_norm_gated(o.astype(x.dtype), z, p["norm"], cfg.rms_norm_eps).reshape(B, T, HV * dv)
    return o @ p["out"]


def decoder_layer(layer, cfg: ModelConfig, mixer: str, x, positions):
    """One pre-norm decoder layer; mixer is config.FULL or config.LINEAR. x [B, T, H]."""
    if mixer == FULL:
        return chain_layer(layer, cfg, x, positions)[0]
    h = gated_delta_net(layer["gdn"], cfg, layers.rms_norm(x, layer["input_norm"], cfg.rms_norm_eps,
                                                            cfg.zero_centered_norm))
    return _mlp_block(layer, cfg, x + h)


def chain_layer(layer, cfg: ModelConfig, x, positions, past=()):
    """A full-attention decoder layer as pass len(past) of a chain (chain_attention). Returns (x, (k, v))."""
    h, kv = chain_attention(layer["attn"], cfg, layers.rms_norm(x, layer["input_norm"], cfg.rms_norm_eps,
                                                                 cfg.zero_centered_norm), positions, past)
    return _mlp_block(layer, cfg, x + h), kv


def _mlp_block(layer, cfg: ModelConfig, x):
    return x + layers.feed_forward(layer, cfg, layers.rms_norm(x, layer["post_norm"], cfg.rms_norm_eps,
                                                               cfg.zero_centered_norm))


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


def forward_with_taps(params, cfg: ModelConfig, tokens, taps: tuple[int, ...]):
    """One pass -> (taps [B, T, len(taps) * H] as forward_hidden gives them, hidden [B, T, H] after
    the final norm, float32 logits [B, T, V]): what a tap drafter is trained on and against."""
    H = cfg.hidden_size
    stacked = forward_hidden(params, cfg, tokens, tuple(taps) + (cfg.num_hidden_layers - 1,))
    hidden = layers.rms_norm(stacked[..., -H:], params["norm"], cfg.rms_norm_eps, cfg.zero_centered_norm)
    return stacked[..., :-H], hidden, logits_from_hidden(params, cfg, hidden)


def shift_right(x):
    """x [B, T, ..] -> row t holds row t - 1 of x (row 0 zeros): what a chain's next pass reads."""
    return jnp.concatenate([jnp.zeros_like(x[:, :1]), x[:, :-1]], axis=1)


def mtp_chain_hidden(params, cfg: ModelConfig, hidden, next_tokens, steps: int) -> list:
    """The MTP head (docs/model_math.md#mtp-head) over whole sequences as it drafts at k = steps
    (speculative/mtp.py): hidden [B, T, H] from forward_hidden; next_tokens [B, T] with
    next_tokens[:, t] = token t+1. Pass 0 row t: fc(cat[norm_e(embed(token t+1)), norm_h(hidden_t)])
    -> the MTP decoder layers (causal over rows, RoPE position t+1, the position of the embedded
    token) -> mtp.norm. Pass j row t reads pass j - 1's output at row t - 1 in place of hidden_t and
    attends as chain_mask says: it is draft j + 1 of the chain after the exact row t - j, exactly
    (training-time test), as long as the chain's earlier drafts were the tokens given. Every pass's
    row t predicts token t+2; rows t < j of pass j have no exact start. Returns [steps] x [B, T, H]."""
    mtp, eps, zc = params["mtp"], cfg.rms_norm_eps, cfg.zero_centered_norm
    B, T = next_tokens.shape
    e = layers.rms_norm(params["embed"][next_tokens], mtp["pre_fc_norm_embedding"], eps, zc)
    positions = jnp.broadcast_to(jnp.arange(1, T + 1, dtype=jnp.int32), (B, T))
    pasts, outs = [[] for _ in mtp["layers"]], []
    for _ in range(steps):
        h = layers.rms_norm(hidden, mtp["pre_fc_norm_hidden"], eps, zc)
        x = jnp.concatenate([e, h], axis=-1) @ mtp["fc"]  # [B, T, 2H] @ [2H, H]
        for layer, past in zip(mtp["layers"], pasts, strict=True):
            x, kv = chain_layer(layer, cfg, x, positions, tuple(past))
            past.append(kv)
        outs.append(layers.rms_norm(x, mtp["norm"], eps, zc))
        hidden = shift_right(outs[-1])
    return outs


def mtp_hidden(params, cfg: ModelConfig, hidden, next_tokens):
    """The MTP head's exact rows (pass 0 of mtp_chain_hidden) [B, T, H]; row t's logits (the shared
    lm_head) predict token t+2."""
    return mtp_chain_hidden(params, cfg, hidden, next_tokens, 1)[0]


def mtp_logits(params, cfg: ModelConfig, hidden, next_tokens):
    """float32 logits [B, T, V] of the MTP head; row t predicts token t+2."""
    return logits_from_hidden(params, cfg, mtp_hidden(params, cfg, hidden, next_tokens))
