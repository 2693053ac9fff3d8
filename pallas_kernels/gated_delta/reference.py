"""Pure-JAX Gated DeltaNet references: the oracle for the Pallas kernels and the engine's CPU path.

Math (docs/model_math.md#recurrence), per value head, state `h [dk, dv]` (= S^T of the paper), per token:

    h <- exp(g_t) h                         # decay, g_t <= 0
    h <- h + k_t (beta_t (v_t - h^T k_t))^T # delta-rule write
    o_t = h^T q_t                           # readout uses the state *after* token t

GVA: value head j reads key head j // (HV // HK) (consecutive grouping, as `repeat_interleave`).
q and k arrive L2-normalised (`l2norm`), q already scaled by dk**-0.5. All state math is float32
with HIGHEST matmul precision, so the result does not depend on the backend's default precision.

Pool-level functions (`gdn_verify`, `gdn_prefill`, `conv_update`) implement the step contract of
docs/architecture.md: index 0 of every pool is the null slot/line, tokens `t >= num_valid[b]` are
inert (state unchanged, output ignored), every pool is read before it is written.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

F32 = jnp.float32
_HI = lax.Precision.HIGHEST


def set_rows(pool: jax.Array, idx: jax.Array, rows: jax.Array) -> jax.Array:
    """pool[idx] = rows for idx [n] into pool [S, ...], except that rows aimed at the null slot / line
    0 (padding rows) are dropped: each gets its own out-of-bounds index, so the indices the scatter
    keeps are unique and it need not serialise colliding writes (see write_kv in
    pallas_kernels/attention/reference.py)."""
    n = idx.shape[0]
    idx = jnp.where(idx > 0, idx, pool.shape[0] + jnp.arange(n, dtype=idx.dtype))
    return pool.at[idx].set(rows, mode="drop", unique_indices=True)


def _einsum(spec: str, *xs):
    """jnp.einsum at full float32 precision (no bf16/tf32 passes on accelerators)."""
    return jnp.einsum(spec, *xs, precision=_HI, preferred_element_type=F32)


def l2norm(x, eps: float = 1e-6):
    """x * rsqrt(sum(x**2, -1) + eps) in float32 (eps on the sum, as FLA/HF). x [..., d] -> [..., d] f32."""
    x = x.astype(F32)
    return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _expand_heads(x, num_v_heads: int):
    """Repeat key heads for GVA: x [B, T, HK, d] -> [B, T, HV, d]; value head j <- key head j // r."""
    num_k_heads = x.shape[2]
    if num_v_heads % num_k_heads:
        raise ValueError(f"{num_v_heads=} must be a multiple of {num_k_heads=}")
    return jnp.repeat(x, num_v_heads // num_k_heads, axis=2)


def _prepare(q, k, v, g, beta):
    """Cast to float32 and expand q/k to the value heads. Returns q, k [B,T,HV,dk], v [B,T,HV,dv], g, beta [B,T,HV]."""
    num_v_heads = v.shape[2]
    q = _expand_heads(q.astype(F32), num_v_heads)
    k = _expand_heads(k.astype(F32), num_v_heads)
    return q, k, v.astype(F32), g.astype(F32), beta.astype(F32)


# ----------------------------------------------------------------------------------------------
# Recurrent form (decode / verify)
# ----------------------------------------------------------------------------------------------


def _recurrent_step(h, inputs):
    """One token for every (batch, value head). h [B, HV, dk, dv]; inputs q, k [B, HV, dk], v [B, HV, dv],
    g, beta [B, HV]. Returns (h after the token, (o [B, HV, dv], h))."""
    q, k, v, g, beta = inputs
    h = h * jnp.exp(g)[..., None, None]
    pred = _einsum("bhkv,bhk->bhv", h, k)  # h^T k
    delta = beta[..., None] * (v - pred)
    h = h + k[..., :, None] * delta[..., None, :]
    o = _einsum("bhkv,bhk->bhv", h, q)
    return h, (o, h)


def recurrent_gated_delta(q, k, v, g, beta, h0, *, return_all_states: bool = False):
    """Token-by-token gated delta rule (lax.scan over T, float32).

    Args:
      q: [B, T, HK, dk] L2-normalised and scaled by dk**-0.5.
      k: [B, T, HK, dk] L2-normalised.
      v: [B, T, HV, dv].
      g: [B, T, HV] log decay (<= 0).
      beta: [B, T, HV] write strength in (0, 1).
      h0: [B, HV, dk, dv] float32 initial state.
    Returns:
      o [B, T, HV, dv] float32 and h_final [B, HV, dk, dv] float32, or, with return_all_states,
      o and h_all [B, T, HV, dk, dv] (the state after every token).
    """
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    time_major = [jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta)]
    h_final, (o, h_all) = lax.scan(_recurrent_step, h0.astype(F32), time_major)
    o = jnp.moveaxis(o, 0, 1)
    if return_all_states:
        return o, jnp.moveaxis(h_all, 0, 1)
    return o, h_final


# ----------------------------------------------------------------------------------------------
# Chunked WY/UT form (prefill)
# ----------------------------------------------------------------------------------------------


def _masked_exp(x, mask):
    """exp(x) where mask else 0 (x, mask [..., C, C]); masked entries never reach exp, so no 0 * inf."""
    return jnp.where(mask, jnp.exp(jnp.where(mask, x, 0.0)), 0.0)


def _to_chunks(x, chunk_size: int):
    """[B, Tp, HV, ...] -> [N, B, HV, C, ...] with Tp = N * C."""
    B, Tp, HV = x.shape[:3]
    x = x.reshape(B, Tp // chunk_size, chunk_size, HV, *x.shape[3:])
    return jnp.moveaxis(jnp.moveaxis(x, 1, 0), 2, 3)


def unit_lower_inverse(a, matmul=None):
    """(I + a)^-1 for strictly lower-triangular a [..., C, C], float32.

    Block doubling: if D inverts the diagonal blocks of size s of L = I + a, then over blocks of
    size 2s, inv([[L11, 0], [L21, L22]]) = [[D1, 0], [-D2 L21 D1, D2]] = D - D L_off D, where L_off
    keeps a's lower-left s x s sub-block inside each 2s block. Exact block inversion (as stable as
    substitution), ceil(log2(C)) levels of two matmuls each (none at s = 1, where D = I). Any C: a
    last block cut short by C is still a 2 x 2 block split (L22 smaller, or absent). `matmul(x, y)`
    multiplies the last two dims (default: float32 einsum); the Pallas prefill passes its own dot.

    Why not `lax.linalg.triangular_solve`: on the CPU, jaxlib 0.10's LAPACK kernel fans its batch
    out over XLA's intra-op thread pool and blocks on it, so as many concurrent solves as pool
    threads (tensor-parallel devices running in lockstep, a backward pass) deadlock the process
    (docs/benchmarks.md, "Tensor parallelism")."""
    C = a.shape[-1]
    matmul = matmul or functools.partial(_einsum, "...ij,...jk->...ik")
    i, j = jnp.arange(C)[:, None], jnp.arange(C)[None, :]

    def lower_left(s):  # a's lower-left s x s block inside each 2s block
        return jnp.where((i // (2 * s) == j // (2 * s)) & ((i // s) % 2 == 1) & ((j // s) % 2 == 0), a, 0.0)

    inv = jnp.where(i == j, 1.0, 0.0).astype(a.dtype) - lower_left(1)
    s = 2
    while s < C:
        inv = inv - matmul(inv, matmul(lower_left(s), inv))
        s *= 2
    return inv


def _intra_chunk(q, k, v, g, beta):
    """Everything that does not depend on the state entering a chunk (docs/model_math.md#chunked-prefill).

    Args: q, k [..., C, dk]; v [..., C, dv]; g, beta [..., C] (leading dims = chunks, batch, heads).
    Returns:
      q_dec [..., C, dk] = exp(G_i) q_i (reads the entry state),
      k_dec [..., C, dk] = exp(G_last - G_i) k_i (writes into the exit state),
      u [..., C, dv] = T (beta v),  w [..., C, dk] = T (beta exp(G) k),  T = (I + A)^-1,
      attn [..., C, C] = (q_i . k_j) exp(G_i - G_j) for i >= j (decay-aware Gamma, not the binary mask),
      decay_last [...] = exp(G_last).
    """
    C = g.shape[-1]
    G = jnp.cumsum(g, axis=-1)  # [..., C] log of prod_{s<=i} alpha_s, <= 0
    diff = G[..., :, None] - G[..., None, :]  # [..., C, C] G_i - G_j, <= 0 for i >= j
    row = jnp.arange(C)[:, None]
    col = jnp.arange(C)[None, :]
    gamma_strict = _masked_exp(diff, row > col)
    gamma_incl = _masked_exp(diff, row >= col)
    # A_ij = beta_i (k_i . k_j) exp(G_i - G_j), strictly lower; T = (I + A)^-1 exactly, by block
    # doubling (matmuls, no LAPACK call: see unit_lower_inverse).
    a = beta[..., :, None] * _einsum("...id,...jd->...ij", k, k) * gamma_strict
    t = unit_lower_inverse(a)
    u = _einsum("...ij,...jd->...id", t, beta[..., None] * v)  # T (beta v)
    w = _einsum("...ij,...jd->...id", t, (beta * jnp.exp(G))[..., None] * k)  # T (beta exp(G) k)
    attn = _einsum("...id,...jd->...ij", q, k) * gamma_incl
    q_dec = jnp.exp(G)[..., None] * q
    k_dec = jnp.exp(G[..., -1:] - G)[..., None] * k
    return q_dec, k_dec, u, w, attn, jnp.exp(G[..., -1])


def _chunk_step(h, chunk):
    """Carry the state across one chunk. h [B, HV, dk, dv]; chunk = _intra_chunk outputs for one chunk.
    Returns (exit state, o [B, HV, C, dv])."""
    q_dec, k_dec, u, w, attn, decay_last = chunk
    v_new = u - _einsum("bhcd,bhdv->bhcv", w, h)  # corrected values [B, HV, C, dv]
    o = _einsum("bhcd,bhdv->bhcv", q_dec, h) + _einsum("bhij,bhjv->bhiv", attn, v_new)
    h = decay_last[..., None, None] * h + _einsum("bhcd,bhcv->bhdv", k_dec, v_new)
    return h, o


def chunk_gated_delta(q, k, v, g, beta, h0, *, chunk_size: int = 64):
    """Chunked (WY/UT) gated delta rule; same math as `recurrent_gated_delta`.

    Args: as `recurrent_gated_delta` (q, k [B, T, HK, dk]; v [B, T, HV, dv]; g, beta [B, T, HV];
      h0 [B, HV, dk, dv] float32). T need not divide chunk_size: the
      tail is padded with g = beta = 0 and q = k = v = 0, which leaves the state unchanged, and sliced off.
    Returns: o [B, T, HV, dv] float32, h_final [B, HV, dk, dv] float32.
    """
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    B, T, HV, dv = v.shape
    pad = (-T) % chunk_size
    q, k, v, g, beta = (jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)) for x in (q, k, v, g, beta))
    chunks = _intra_chunk(*(_to_chunks(x, chunk_size) for x in (q, k, v, g, beta)))
    h_final, o = lax.scan(_chunk_step, h0.astype(F32), chunks)  # o [N, B, HV, C, dv]
    o = jnp.moveaxis(o, 0, 2).reshape(B, HV, T + pad, dv)
    return jnp.moveaxis(o, 1, 2)[:, :T], h_final


# ----------------------------------------------------------------------------------------------
# Causal depthwise conv
# ----------------------------------------------------------------------------------------------


def _silu_conv(xs, weight, T: int):
    """silu of the causal depthwise conv, float32. xs [B, K-1+T, C] (history then tokens), weight [K, C].
    Returns [B, T, C] float32: y_t = silu(sum_i weight[i] * xs[t + i])."""
    K = weight.shape[0]
    xs = xs.astype(F32)
    w = weight.astype(F32)
    acc = sum(xs[:, i : i + T] * w[i] for i in range(K))
    return jax.nn.silu(acc)


def causal_conv1d(x, weight, state):
    """Causal depthwise conv + SiLU over a sequence continuing from `state`.

    Args:
      x: [B, T, C] raw (pre-conv) inputs.
      weight: [K, C]; weight[K-1] multiplies the current token, weight[0] the oldest.
      state: [B, K-1, C] the previous K-1 raw inputs, oldest first (zeros for a fresh sequence).
    Returns: y [B, T, C] in x.dtype (computed in float32), new_state [B, K-1, C] = the last K-1 raw
      inputs of concat(state, x).
    """
    T = x.shape[1]
    xs = jnp.concatenate([state.astype(x.dtype), x], axis=1)  # [B, K-1+T, C]
    return _silu_conv(xs, weight, T).astype(x.dtype), xs[:, T:]


def _rows_slice(x, start, size: int):
    """Per-row dynamic slice along axis 1: x [B, L, C], start [B] -> [B, size, C] (start clamped in range)."""
    return jax.vmap(lambda xb, sb: lax.dynamic_slice_in_dim(xb, sb, size, axis=0))(x, start)


def conv_update(x, lines, weight, read_row, offset, write_row, has_state, num_valid, *, mode: str):
    """Conv step on the per-request sliding-window lines (docs/model_math.md#conv-window-under-speculation).

    Args:
      x: [B, T, C'] raw inputs of this step; only the first C channels are read (C' > C: the conv's
        input is the leading part of a wider projection, e.g. merged with the z projection).
      lines: [N, L, C] conv lines, L = (K-1) + k_max; line 0 is the null line.
      weight: [K, C] depthwise weights (K >= 2).
      read_row: [B] int32 line holding each request's window (0 for padding rows).
      offset: [B] int32 window start (= num_accepted - 1; negative values are clamped to 0).
      write_row: [B] int32 line receiving the new window (the target engine: read_row; a draft
        engine with one window per state slot: the slot after this token). Beyond the rewritten
        head, the written line keeps the rest of the read line.
      has_state: [B] bool; False -> the window is zeros (fresh sequence).
      num_valid: [B] int32 real tokens per row (used by mode "prefill").
      mode: "verify" rewrites the line to [old[off+1 : off+K-1], x_0 .. x_{T-1}] (needs K-2+T <= L);
        "prefill" writes the last K-1 inputs of concat(window, x[:num_valid]) to line[0 : K-1].
        The rest of the line is left unchanged. Everything is read before anything is written.
    Returns: y [B, T, C] in x.dtype (silu(conv) in float32), lines [N, L, C].
    """
    K, T, L = weight.shape[0], x.shape[1], lines.shape[1]
    if K < 2:
        raise ValueError(f"conv kernel size {K=} must be >= 2")
    if x.shape[2] < lines.shape[2]:
        raise ValueError(f"x has {x.shape[2]} channels, fewer than the lines' {lines.shape[2]}")
    x = x[..., :lines.shape[2]]
    old = lines[read_row]  # [B, L, C]
    window = _rows_slice(old, jnp.maximum(offset, 0), K - 1)  # [B, K-1, C]
    window = jnp.where(has_state[:, None, None], window, jnp.zeros_like(window))
    xs = jnp.concatenate([window.astype(x.dtype), x], axis=1)  # [B, K-1+T, C]
    y = _silu_conv(xs, weight, T).astype(x.dtype)
    if mode == "verify":
        if K - 2 + T > L:
            raise ValueError(f"verify needs K-2+T <= L, got {K=}, {T=}, {L=}")
        head = xs[:, 1:]  # [B, K-2+T, C] = old[off+1 : off+K-1] ++ x
    elif mode == "prefill":
        head = _rows_slice(xs, num_valid, K - 1)  # xs[nv : nv+K-1], the last K-1 valid inputs
    else:
        raise ValueError(f"{mode=} must be 'verify' or 'prefill'")
    new = lax.dynamic_update_slice_in_dim(old, head.astype(lines.dtype), 0, axis=1)
    return y, set_rows(lines, write_row, new)


# ----------------------------------------------------------------------------------------------
# State-pool functions (engine entry points)
# ----------------------------------------------------------------------------------------------


def _mask_inert(q, k, v, g, beta, num_valid):
    """Zero every input of tokens t >= num_valid[b] (g = beta = 0 leaves the state unchanged; zeroing
    q/k/v as well keeps garbage, even inf/NaN, in padding out of the math). Shapes as the recurrence."""
    valid = jnp.arange(g.shape[1])[None, :] < num_valid[:, None]  # [B, T]

    def mask(x):
        m = valid.reshape(valid.shape + (1,) * (x.ndim - 2))
        return jnp.where(m, x.astype(F32), 0.0)

    return tuple(mask(x) for x in (q, k, v, g, beta))


def _read_state(pool, read_idx, has_state):
    """h0 [B, HV, dk, dv] float32 = pool[read_idx] (zeros where not has_state). pool [S, HV, dk, dv]."""
    h0 = pool[read_idx].astype(F32)
    return jnp.where(has_state[:, None, None, None], h0, 0.0)


def gdn_verify(q, k, v, g, beta, pool, read_idx, write_idx, has_state, num_valid):
    """Verify/decode step with one state snapshot per token (decode is T = 1).

    Args:
      q, k: [B, T, HK, dk] (normalised; q scaled); v: [B, T, HV, dv]; g, beta: [B, T, HV].
      pool: [S, HV, dk, dv] float32 state pool (slot 0 = null slot).
      read_idx: [B] int32 slot of the start state, read before any write (it may be a write slot).
      write_idx: [B, T] int32 slot receiving the state after token t.
      has_state: [B] bool; False -> start from zeros.
      num_valid: [B] int32; tokens t >= num_valid are inert (their snapshot equals the previous one).
    Returns: o [B, T, HV, dv] float32, pool [S, HV, dk, dv].
    """
    B, T = v.shape[:2]
    h0 = _read_state(pool, read_idx, has_state)
    o, h_all = recurrent_gated_delta(*_mask_inert(q, k, v, g, beta, num_valid), h0, return_all_states=True)
    h_all = h_all.reshape(B * T, *pool.shape[1:]).astype(pool.dtype)
    return o, set_rows(pool, write_idx.reshape(B * T), h_all)


def gdn_prefill(q, k, v, g, beta, pool, read_idx, write_idx, has_state, num_valid, *, chunk_size: int = 64):
    """Prefill step (chunked form), keeping only the state after the last valid token.

    Args: as `gdn_verify`, except write_idx [B] int32: the slot receiving the final state.
    Returns: o [B, T, HV, dv] float32, pool [S, HV, dk, dv].
    """
    h0 = _read_state(pool, read_idx, has_state)
    o, h_final = chunk_gated_delta(*_mask_inert(q, k, v, g, beta, num_valid), h0, chunk_size=chunk_size)
    return o, set_rows(pool, write_idx, h_final.astype(pool.dtype))


# ----------------------------------------------------------------------------------------------
# From the conv's output: the layer's glue before the recurrence
# ----------------------------------------------------------------------------------------------


def key_heads(channels: int, num_v_heads: int, dk: int, dv: int) -> int:
    """HK of a conv output with `channels` = HK * 2 dk + HV * dv channels (HV a multiple of HK)."""
    hk, rest = divmod(channels - num_v_heads * dv, 2 * dk)
    if rest or hk <= 0 or num_v_heads % hk:
        raise ValueError(f"{channels=} is not HK * 2 * {dk} + {num_v_heads} * {dv} with {num_v_heads} value heads a "
                         "multiple of HK key heads")
    return hk


def split_heads(mixed, num_v_heads: int, dk: int, dv: int):
    """The conv output mixed [B, T, C], channels grouped per key head h as [q_h (dk) | k_h (dk) | v_h (r dv)]
    where v_h holds value heads h r .. h r + r - 1 (r = HV / HK) -> q, k [B, T, HK, dk], v [B, T, HV, dv]."""
    hk = key_heads(mixed.shape[-1], num_v_heads, dk, dv)
    g = mixed.reshape(*mixed.shape[:-1], hk, mixed.shape[-1] // hk)
    return g[..., :dk], g[..., dk:2 * dk], g[..., 2 * dk:].reshape(*mixed.shape[:-1], num_v_heads, dv)


def gates(a, b, a_log, dt_bias):
    """Per-token gates from the a / b projections [B, T, HV] and the per-head A_log, dt_bias [HV]:
    g = -exp(A_log) softplus(a + dt_bias) (log decay, <= 0) and beta = sigmoid(b), both computed in
    float32 from the projections as given. (HF rounds a bfloat16 beta back to bfloat16; that rounding
    is not kept: XLA:CPU expands a bfloat16 sigmoid into steps that each round, and XLA's GPU
    compiler drops a float32 -> bfloat16 -> float32 round trip, so it would differ per backend.)"""
    beta = jax.nn.sigmoid(b.astype(F32))
    g = -jnp.exp(a_log.astype(F32)) * jax.nn.softplus(a.astype(F32) + dt_bias.astype(F32))
    return g, beta


def gdn_inputs(mixed, a, b, a_log, dt_bias, *, dk: int, dv: int):
    """The recurrence's inputs from the conv output and the gate projections: q, k L2-normalised
    (q scaled by dk**-0.5) float32 [B, T, HK, dk], v [B, T, HV, dv] in mixed's dtype, g, beta float32."""
    q, k, v = split_heads(mixed, a.shape[-1], dk, dv)
    g, beta = gates(a, b, a_log, dt_bias)
    return l2norm(q) * dk ** -0.5, l2norm(k), v, g, beta


def gdn_verify_mixed(mixed, a, b, a_log, dt_bias, pool, read_idx, write_idx, has_state, num_valid):
    """`gdn_verify` on `gdn_inputs(mixed, a, b, a_log, dt_bias)`; dk, dv are the pool's [S, HV, dk, dv]."""
    dk, dv = pool.shape[2:]
    return gdn_verify(*gdn_inputs(mixed, a, b, a_log, dt_bias, dk=dk, dv=dv), pool, read_idx, write_idx,
                      has_state, num_valid)


# ----------------------------------------------------------------------------------------------
# Test oracle
# ----------------------------------------------------------------------------------------------


def naive_gated_delta(q, k, v, g, beta, h0):
    """Per-token float64 numpy loop (the plainest statement of the math), for tests only.

    Args: q, k [B, T, HK, dk]; v [B, T, HV, dv]; g, beta [B, T, HV]; h0 [B, HV, dk, dv].
    Returns: o [B, T, HV, dv], h_all [B, T, HV, dk, dv] (state after every token), both float64.
    """
    q, k, v, g, beta, h = (np.asarray(x, np.float64) for x in (q, k, v, g, beta, h0))
    B, T, HV, dv = v.shape
    r = HV // k.shape[2]
    o = np.zeros((B, T, HV, dv))
    h_all = np.zeros((B, T) + h.shape[1:])
    h = h.copy()
    for t in range(T):
        for j in range(HV):
            kt, qt = k[:, t, j // r], q[:, t, j // r]  # [B, dk]
            h[:, j] *= np.exp(g[:, t, j])[:, None, None]
            delta = beta[:, t, j, None] * (v[:, t, j] - np.einsum("bkv,bk->bv", h[:, j], kt))
            h[:, j] += kt[:, :, None] * delta[:, None, :]
            o[:, t, j] = np.einsum("bkv,bk->bv", h[:, j], qt)
        h_all[:, t] = h
    return o, h_all
