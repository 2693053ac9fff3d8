"""GDN chunked prefill: two Pallas kernels (Triton lowering), WY/UT form (docs/model_math.md#chunked-prefill).

Same semantics as `reference.gdn_prefill`. Not one fused kernel but two, both in Pallas, split where
the work stops depending on the state (as FLA splits it):

1. `_intra_chunk_kernel`, grid (request, value head, chunk), all chunks in parallel. With
   G = cumsum(g) inside the chunk and A_ij = beta_i (k_i . k_j) exp(G_i - G_j) for i > j, it forms
   T = (I + A)^-1 in float32 by forward substitution over the C rows, then u = T (beta v) and
   w = T (beta exp(G) k). Writes u [C, dv], w [C, dk], G [C] (float32) per chunk.
2. `_state_pass_kernel`, grid (request, value head, V-block), sequential over the chunks, state
   tile h [dk, BV] in float32 registers, starting from pool[read_idx] (zeros if not has_state):
       v_new = u - w h
       o     = (exp(G) q) h + (q k^T * exp(G_i - G_j), i >= j) v_new
       h    <- exp(G_last) h + (exp(G_last - G) k)^T v_new
   and finally h -> pool[write_idx], in place through `input_output_aliases`.

Tokens t >= num_valid are inert: q/k/v/g/beta are loaded as zeros (masked loads), as the reference
zeroes them, so they leave the state unchanged and read out 0. Chunks entirely past num_valid are
skipped (their outputs are written as zeros). Decay matrices are masked before exp, so with g <= 0
every exp argument is <= 0 (G_i - G_j for i >= j, G_last - G_i, G_i) and no 0 * inf appears.
Dots on float32 operands use HIGHEST precision (an IEEE fp32 dot, not TF32); bfloat16 q/k/v take
the tensor-core path for q k^T and k k^T (exact products, float32 accumulation).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.triton_common import MIN_DOT, ignore_triton_deprecation, is_pow2, triton_compiler_params

F32 = jnp.float32


def _dot(a, b, *, trans_a: bool = False, trans_b: bool = False):
    """a @ b (a^T / b^T when asked) -> float32; float32 operands at HIGHEST precision."""
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    precision = lax.Precision.HIGHEST if a.dtype == F32 else None
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=F32)


def _load_rows(ref, start, live):
    """Rows start .. start+C of ref ([T, d] or [T]); rows where `live` [C] is False read as 0.
    The masked load also keeps the tail chunk (start + C > T) in bounds."""
    view = ref.at[pl.ds(start, live.shape[0])]
    mask = live if len(ref.shape) == 1 else live[:, None]
    return pltriton.load(view, mask=mask, other=0.0)


def _decay(G, *, strict: bool):
    """[C] cumulative log decay -> [C, C] exp(G_i - G_j) on the (strictly) lower triangle, else 0.
    Masked before exp, so every exp argument is <= 0 (G is non-increasing) and no 0 * inf appears."""
    n = G.shape[0]
    row, col = jnp.arange(n)[:, None], jnp.arange(n)[None, :]
    mask = row > col if strict else row >= col
    return jnp.where(mask, jnp.exp(jnp.where(mask, G[:, None] - G[None, :], 0.0)), 0.0)


def _unit_lower_inverse(a):
    """(I + a)^-1 for strictly lower a [C, C], float32, by forward substitution over rows:
    row i of T = e_i - sum_{j<i} a_ij T_j (static trip count; rows picked with masks, not slices)."""
    n = a.shape[0]
    rows, cols = jnp.arange(n)[:, None], jnp.arange(n)

    def row_step(i, t):
        a_i = jnp.sum(jnp.where(rows == i, a, 0.0), axis=0)  # [C] row i of a
        t_i = jnp.where(cols == i, 1.0, 0.0) - jnp.sum(a_i[:, None] * t, axis=0)  # [C]
        return jnp.where(rows == i, t_i[None, :], t)

    return lax.fori_loop(0, n, row_step, jnp.zeros((n, n), F32))


def _intra_chunk_kernel(
    k_ref,  # [T, dk]   keys of this request, key head h // r (normalised)
    v_ref,  # [T, dv]   values, value head h
    g_ref,  # [T]       log decay
    beta_ref,  # [T]    write strength
    valid_ref,  # [1] int32 num_valid
    u_ref,  # [C, dv] f32   out: T (beta v)
    w_ref,  # [C, dk] f32   out: T (beta exp(G) k)
    gcum_ref,  # [C] f32    out: G = cumsum(g) within the chunk
):
    n = gcum_ref.shape[0]
    start = pl.program_id(2) * n
    n_live = jnp.minimum(valid_ref[0], k_ref.shape[0])

    @pl.when(start < n_live)  # a chunk past num_valid is never read by the state pass
    def _():
        live = start + jnp.arange(n) < n_live  # [C]
        k, v = _load_rows(k_ref, start, live), _load_rows(v_ref, start, live)
        g = _load_rows(g_ref, start, live).astype(F32)
        beta = _load_rows(beta_ref, start, live).astype(F32)
        G = jnp.cumsum(g)  # [C] <= 0, non-increasing
        a = beta[:, None] * _dot(k, k, trans_b=True) * _decay(G, strict=True)  # [C, C]
        t_inv = _unit_lower_inverse(a)
        u_ref[...] = _dot(t_inv, beta[:, None] * v.astype(F32))
        w_ref[...] = _dot(t_inv, (beta * jnp.exp(G))[:, None] * k.astype(F32))
        gcum_ref[...] = G


def _state_pass_kernel(
    q_ref,  # [T, dk]     queries, key head h // r (normalised, scaled)
    k_ref,  # [T, dk]     keys, key head h // r
    u_ref,  # [Tp, BV] f32  from the intra-chunk kernel, this V-block
    w_ref,  # [Tp, dk] f32
    gcum_ref,  # [Tp] f32
    pool_ref,  # [S, dk, BV] state pool as read (this head, this V-block)
    read_ref,  # [1] int32
    write_ref,  # [1] int32
    has_ref,  # [1] int32
    valid_ref,  # [1] int32
    o_ref,  # [T, BV] f32
    pool_out_ref,  # [S, dk, BV] the same pool buffer (aliased), receives the final state
    *,
    chunk_size: int,
    barrier: bool,
):
    seq_len, n = q_ref.shape[0], chunk_size
    n_live = jnp.minimum(valid_ref[0], seq_len)
    h = jnp.where(has_ref[0] != 0, pool_ref[read_ref[0]].astype(F32), 0.0)  # [dk, BV]
    if barrier:  # the start tile is in registers before the final state is stored
        pltriton.debug_barrier()

    def in_bounds(start):  # [C, 1] rows of this chunk that exist in o
        return (start + jnp.arange(n) < seq_len)[:, None]

    def chunk(c, h):
        start = c * n
        live = start + jnp.arange(n) < n_live
        q, k = _load_rows(q_ref, start, live), _load_rows(k_ref, start, live)  # [C, dk]
        u, w = u_ref[pl.ds(start, n)], w_ref[pl.ds(start, n)]  # [C, BV], [C, dk]
        G = gcum_ref[pl.ds(start, n)]  # [C]
        g_last = gcum_ref[start + n - 1]
        attn = _dot(q, k, trans_b=True) * _decay(G, strict=False)  # [C, C]
        v_new = u - _dot(w, h)  # [C, BV] corrected values
        o = _dot(jnp.exp(G)[:, None] * q.astype(F32), h) + _dot(attn, v_new)
        pltriton.store(o_ref.at[pl.ds(start, n)], o.astype(o_ref.dtype), mask=in_bounds(start))
        k_dec = jnp.exp(g_last - G)[:, None] * k.astype(F32)  # [C, dk]
        return jnp.exp(g_last) * h + _dot(k_dec, v_new, trans_a=True)

    def zero_chunk(c, carry):  # chunks past num_valid read out 0 (the reference zeroes their q)
        start = c * n
        pltriton.store(o_ref.at[pl.ds(start, n)], jnp.zeros((n, o_ref.shape[1]), o_ref.dtype), mask=in_bounds(start))
        return carry

    n_live_chunks = pl.cdiv(n_live, n)
    h = lax.fori_loop(0, n_live_chunks, chunk, h)
    lax.fori_loop(n_live_chunks, pl.cdiv(seq_len, n), zero_chunk, 0)
    pool_out_ref[write_ref[0]] = h.astype(pool_out_ref.dtype)


def _check(q, v, pool, chunk_size: int, block_v: int):
    hk, dk = q.shape[2:]
    hv, dv = v.shape[2:]
    if hv % hk:
        raise ValueError(f"value heads {hv=} must be a multiple of key heads {hk=}")
    if pool.shape[1:] != (hv, dk, dv):
        raise ValueError(f"pool shape {pool.shape} must be [S, {hv}, {dk}, {dv}]")
    for name, size in (("dk", dk), ("dv", dv), ("chunk_size", chunk_size), ("block_v", block_v)):
        if not is_pow2(size) or size < MIN_DOT:
            raise ValueError(f"{name}={size} must be a power of two >= {MIN_DOT} (Triton dots)")
    if dv % block_v:
        raise ValueError(f"{block_v=} must divide {dv=}")


def _intra_chunk(k, v, g, beta, num_valid, *, chunk_size, hv, interpret, num_warps):
    """u [B, HV, Tp, dv], w [B, HV, Tp, dk], G [B, HV, Tp] (float32, Tp = chunks * C)."""
    b, t, hk, dk = k.shape
    dv, r = v.shape[3], hv // hk
    n_chunks = pl.cdiv(t, chunk_size)
    tp = n_chunks * chunk_size
    call = pl.pallas_call(
        _intra_chunk_kernel,
        grid=(b, hv, n_chunks),
        in_specs=[
            pl.BlockSpec((None, t, None, dk), lambda i, h, c: (i, 0, h // r, 0)),  # k
            pl.BlockSpec((None, t, None, dv), lambda i, h, c: (i, 0, h, 0)),  # v
            pl.BlockSpec((None, t, None), lambda i, h, c: (i, 0, h)),  # g
            pl.BlockSpec((None, t, None), lambda i, h, c: (i, 0, h)),  # beta
            pl.BlockSpec((1,), lambda i, h, c: (i,)),  # num_valid
        ],
        out_specs=[
            pl.BlockSpec((None, None, chunk_size, dv), lambda i, h, c: (i, h, c, 0)),
            pl.BlockSpec((None, None, chunk_size, dk), lambda i, h, c: (i, h, c, 0)),
            pl.BlockSpec((None, None, chunk_size), lambda i, h, c: (i, h, c)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, hv, tp, dv), F32),
            jax.ShapeDtypeStruct((b, hv, tp, dk), F32),
            jax.ShapeDtypeStruct((b, hv, tp), F32),
        ],
        compiler_params=triton_compiler_params(num_warps, num_stages=1),
        interpret=interpret,
        name="gdn_intra_chunk",
    )
    return call(k, v, g, beta, num_valid)


def gdn_prefill_pallas(
    q: jax.Array,  # [B, T, HK, dk] L2-normalised, scaled by dk**-0.5
    k: jax.Array,  # [B, T, HK, dk] L2-normalised
    v: jax.Array,  # [B, T, HV, dv]
    g: jax.Array,  # [B, T, HV] log decay
    beta: jax.Array,  # [B, T, HV]
    pool: jax.Array,  # [S, HV, dk, dv] float32 state pool (slot 0 = null slot)
    read_idx: jax.Array,  # [B] int32
    write_idx: jax.Array,  # [B] int32
    has_state: jax.Array,  # [B] bool
    num_valid: jax.Array,  # [B] int32
    *,
    chunk_size: int = 64,
    interpret: bool = False,
    block_v: int | None = None,
    num_warps: int = 4,
) -> tuple[jax.Array, jax.Array]:
    """Pallas chunked GDN prefill; same contract as `reference.gdn_prefill`.

    Returns o [B, T, HV, dv] float32 and the pool with pool[write_idx[b]] = the state after the
    last valid token. T need not be a multiple of `chunk_size` (16, 32 or 64). `block_v` (power of
    two >= 16 dividing dv, default min(32, dv)) is the V-block of the state pass. With duplicate
    write slots (padding rows write the null slot 0) slot 0 holds any one of them.
    """
    b, t, hk, dk = q.shape
    hv, dv = v.shape[2:]
    block_v = block_v or min(32, dv)
    _check(q, v, pool, chunk_size, block_v)
    i32 = jnp.int32
    num_valid = num_valid.astype(i32)
    r, n_slots = hv // hk, pool.shape[0]
    with ignore_triton_deprecation():
        u, w, gcum = _intra_chunk(
            k, v, g, beta, num_valid, chunk_size=chunk_size, hv=hv, interpret=interpret, num_warps=num_warps
        )
        tp = u.shape[2]
        key_spec = pl.BlockSpec((None, t, None, dk), lambda i, h, j: (i, 0, h // r, 0))
        pool_spec = pl.BlockSpec((n_slots, None, dk, block_v), lambda i, h, j: (0, h, 0, j))
        scalar_spec = pl.BlockSpec((1,), lambda i, h, j: (i,))
        out_spec = pl.BlockSpec((None, t, None, block_v), lambda i, h, j: (i, 0, h, j))
        call = pl.pallas_call(
            functools.partial(_state_pass_kernel, chunk_size=chunk_size, barrier=not interpret),
            grid=(b, hv, dv // block_v),
            in_specs=[
                key_spec,  # q
                key_spec,  # k
                pl.BlockSpec((None, None, tp, block_v), lambda i, h, j: (i, h, 0, j)),  # u
                pl.BlockSpec((None, None, tp, dk), lambda i, h, j: (i, h, 0, 0)),  # w
                pl.BlockSpec((None, None, tp), lambda i, h, j: (i, h, 0)),  # G
                pool_spec,
                scalar_spec,  # read_idx
                scalar_spec,  # write_idx
                scalar_spec,  # has_state
                scalar_spec,  # num_valid
            ],
            out_specs=[out_spec, pool_spec],
            out_shape=[jax.ShapeDtypeStruct((b, t, hv, dv), F32), jax.ShapeDtypeStruct(pool.shape, pool.dtype)],
            input_output_aliases={5: 1},
            compiler_params=triton_compiler_params(num_warps, num_stages=1),
            interpret=interpret,
            name="gdn_chunk_state_pass",
        )
        return call(
            q, k, u, w, gcum, pool,
            read_idx.astype(i32), write_idx.astype(i32), has_state.astype(i32), num_valid,
        )
