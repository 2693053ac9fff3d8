"""Full-sequence forward for training (no paged caches), over the params layout of
docs/architecture.md, so that trained params load straight into jaxspec.

Same math as `model.forward` with the engine's caches replaced by a whole sequence: dense causal
attention instead of paged attention, and for GDN the reference `causal_conv1d` (zero start window)
and the chunked WY/UT form of the reference `chunk_gated_delta` (zero start state), with one change:
T = (I + A)^-1 comes from log2(C) levels of block-doubling matmuls instead of
`lax.linalg.triangular_solve`. The math is the same; the reason is jaxlib 0.10's CPU LAPACK kernels,
which fan a batch out over XLA's intra-op pool and block on it, so two triangular solves running
concurrently on a 2-thread pool (as a backward pass schedules them) deadlock (seen here: both pool
threads parked in `lapack_strsm_ffi` -> `ParallelBatchMap` -> `BlockingCounter::Wait`).
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


def unit_lower_inverse(a):
    """(I + a)^-1 for strictly lower-triangular a [..., C, C], C a power of two, float32.

    Block doubling: if D inverts the diagonal blocks of size s of L = I + a, then over blocks of
    size 2s, inv([[L11, 0], [L21, L22]]) = [[D1, 0], [-D2 L21 D1, D2]] = D - D L_off D, where L_off
    keeps a's lower-left s x s sub-block inside each 2s block. Exact block inversion (as stable as
    substitution), log2(C) levels of two matmuls each, no LAPACK call."""
    C = a.shape[-1]
    if C & (C - 1):
        raise ValueError(f"chunk size {C} must be a power of two")
    i, j = jnp.arange(C)[:, None], jnp.arange(C)[None, :]
    inv = jnp.broadcast_to(jnp.eye(C, dtype=a.dtype), a.shape)
    s = 1
    while s < C:
        off = (i // (2 * s) == j // (2 * s)) & ((i // s) % 2 == 1) & ((j // s) % 2 == 0)  # [C, C]
        inv = inv - gdn_ref._einsum("...ij,...jk->...ik", inv, gdn_ref._einsum("...ij,...jk->...ik",
                                                                                jnp.where(off, a, 0.0), inv))
        s *= 2
    return inv


def _intra_chunk(q, k, v, g, beta):
    """The reference's `_intra_chunk` (same inputs and outputs, [..., C, ...] per chunk) with
    T = (I + A)^-1 from `unit_lower_inverse`."""
    C = g.shape[-1]
    G = jnp.cumsum(g, axis=-1)  # [..., C] log of prod_{s<=i} alpha_s
    diff = G[..., :, None] - G[..., None, :]  # [..., C, C] G_i - G_j
    row, col = jnp.arange(C)[:, None], jnp.arange(C)[None, :]
    gamma_strict = gdn_ref._masked_exp(diff, row > col)
    gamma_incl = gdn_ref._masked_exp(diff, row >= col)
    a = beta[..., :, None] * gdn_ref._einsum("...id,...jd->...ij", k, k) * gamma_strict  # A, strictly lower
    t = unit_lower_inverse(a)
    u = gdn_ref._einsum("...ij,...jd->...id", t, beta[..., None] * v)  # T (beta v)
    w = gdn_ref._einsum("...ij,...jd->...id", t, (beta * jnp.exp(G))[..., None] * k)  # T (beta exp(G) k)
    attn = gdn_ref._einsum("...id,...jd->...ij", q, k) * gamma_incl
    q_dec = jnp.exp(G)[..., None] * q
    k_dec = jnp.exp(G[..., -1:] - G)[..., None] * k
    return q_dec, k_dec, u, w, attn, jnp.exp(G[..., -1])


def chunk_gated_delta(q, k, v, g, beta, *, chunk_size: int = GDN_CHUNK):
    """The reference `chunk_gated_delta` from a zero state (see the module docstring). q, k
    [B, T, HK, dk] (normalised, q scaled); v [B, T, HV, dv]; g, beta [B, T, HV] -> o [B, T, HV, dv] f32."""
    q, k, v, g, beta = gdn_ref._prepare(q, k, v, g, beta)
    B, T, HV, dv = v.shape
    pad = (-T) % chunk_size  # g = beta = 0 and q = k = v = 0 leave the state unchanged
    q, k, v, g, beta = (jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)) for x in (q, k, v, g, beta))
    chunks = _intra_chunk(*(gdn_ref._to_chunks(x, chunk_size) for x in (q, k, v, g, beta)))
    h0 = jnp.zeros((B, HV, q.shape[-1], dv), F32)
    _, o = jax.lax.scan(gdn_ref._chunk_step, h0, chunks)  # o [N, B, HV, C, dv]
    o = jnp.moveaxis(o, 0, 2).reshape(B, HV, T + pad, dv)
    return jnp.moveaxis(o, 1, 2)[:, :T]


def _qkv(p, cfg: ModelConfig, x, positions):
    """Roped q [B, T, nH, D], k, v [B, T, nKV, D] and the output gate [B, T, nH*D] (or None) of x
    [B, T, H_in] (H_in = 2H for the EAGLE-3 layer); QK-norm where the layer has it."""
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
