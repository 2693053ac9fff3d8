"""GDN chunked prefill: three Pallas kernels (Triton lowering), WY/UT form (docs/model_math.md#chunked-prefill).

Same semantics as `reference.gdn_prefill`. Split where the work stops depending on the state (as
FLA splits it), so only the middle kernel walks the chunks in order:

1. `_intra_chunk_kernel`, grid (request, value head, chunk), all chunks in parallel. With
   G = cumsum(g) inside the chunk and A_ij = beta_i (k_i . k_j) exp(G_i - G_j) for i > j, it forms
   T = (I + A)^-1 in float32 (`_intra_chunk`: the reference's block doubling, whole-chunk
   dots), u = T (beta v) and
   w = T (beta exp(G) k). Writes u [C, dv], w [C, dk], G [C] (float32) per chunk.
2. `_state_pass_kernel`, grid (request, value head, V-block), sequential over the chunks, state
   tile h [dk, BV] in float32 registers, starting from pool[read_idx] (zeros if not has_state):
       h_c   = h                                   (stored: the state entering chunk c)
       v_new = u - w h                             (stored)
       h    <- exp(G_last) h + (exp(G_last - G) k)^T v_new
   and finally h -> pool[write_idx], in place through `input_output_aliases`.
3. `_output_kernel`, grid (request, value head, V-block, chunk), all chunks in parallel:
       o     = (exp(G) q) h_c + (q k^T * exp(G_i - G_j), i >= j) v_new

Tokens t >= num_valid are inert: q/k/v/g/beta are loaded as zeros (masked loads), as the reference
zeroes them, so they leave the state unchanged and read out 0. Chunks entirely past num_valid are
skipped (their outputs are written as zeros). Decay matrices are masked before exp, so with g <= 0
every exp argument is <= 0 (G_i - G_j for i >= j, G_last - G_i, G_i) and no 0 * inf appears.
Dots on float32 operands run as `f32_dots` says (by default one-pass TF32 for a bfloat16 model,
three-pass for a float32 one: `default_f32_dots`; IEEE in the interpreter); bfloat16 q/k/v take the
tensor-core path for q k^T and k k^T (exact products, float32 accumulation). The stored states cost
B * HV * chunks * dk * dv * 4 bytes of scratch.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.gated_delta.reference import unit_lower_inverse
from pallas_kernels.triton_common import (
    MIN_DOT,
    device_sm_count,
    ignore_triton_deprecation,
    is_pow2,
    triton_compiler_params,
)

F32 = jnp.float32


# How a dot of two float32 operands runs: "ieee" (FMA on the CUDA cores, exact float32 products),
# "tf32x3" (three TF32 tensor-core products per operand pair, the hi / lo split of each float32:
# about float32's accuracy), "tf32" (one TF32 product: operands rounded to 10 mantissa bits) or
# "bf16" (operands rounded to bfloat16, 7 bits, as flash-linear-attention runs its chunk kernels).
# Accumulation is float32 in every mode. The interpreter runs "ieee" for the TF32 modes (XLA:CPU
# has no TF32 algorithm) and rounds to bfloat16 as compiled for "bf16".
F32_DOTS = ("ieee", "tf32x3", "tf32", "bf16")
_TF32_ALGORITHMS = {"tf32x3": lax.DotAlgorithmPreset.TF32_TF32_F32_X3, "tf32": lax.DotAlgorithmPreset.TF32_TF32_F32}


def _dot(a, b, *, trans_a: bool = False, trans_b: bool = False, f32_dots: str = "ieee"):
    """a @ b (a^T / b^T when asked) -> float32; float32 operands by `f32_dots`, bfloat16 ones on
    the tensor cores (exact products, float32 accumulation)."""
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    precision = None
    if a.dtype == F32 and f32_dots == "bf16":
        a, b = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
    elif a.dtype == F32:
        precision = _TF32_ALGORITHMS.get(f32_dots, lax.Precision.HIGHEST)
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=F32)


def default_f32_dots(value_dtype) -> str:
    """How the float32 dots run unless asked, by the dtype of the values (the model's dtype).

    bfloat16: one-pass TF32, 2.4x faster than three-pass on an H100 (Qwen3.5-27B heads, 8 x 512
    tokens: 1011 against 2432 us) for a relative RMS output error of 4.6e-4 against the float32
    reference, under the ~1.7e-3 that rounding the output to bfloat16 (as such a model does before
    the GDN output projection) adds by itself ("bf16" dots, 3.7e-3, would be over it). float32:
    three-pass TF32, about float32's accuracy, for the model that is the exactness reference
    (docs/architecture.md, "Numerics"; docs/benchmarks.md, "Chunked prefill in TF32")."""
    return "tf32x3" if jnp.dtype(value_dtype) == F32 else "tf32"


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


def _intra_chunk(k, v, G, beta, dot):
    """u, w of one chunk from whole-chunk tiles (k [C, dk], v [C, dv], G, beta [C], float32): A by
    one dot, T = (I + A)^-1 by the reference's block doubling (log2(C) - 1 levels of two
    whole-chunk dots, no serial per-row loop), then u and w by one dot each."""
    a = beta[:, None] * dot(k, k, trans_b=True) * _decay(G, strict=True)  # [C, C]
    t = unit_lower_inverse(a, matmul=dot)
    u = dot(t, beta[:, None] * v.astype(F32))
    w = dot(t, (beta * jnp.exp(G))[:, None] * k.astype(F32))
    return u, w


def _intra_chunk_kernel(
    k_ref,  # [T, dk]   keys of this request, key head h // r (normalised)
    v_ref,  # [T, dv]   values, value head h
    g_ref,  # [T]       log decay
    beta_ref,  # [T]    write strength
    valid_ref,  # [1] int32 num_valid
    u_ref,  # [C, dv] f32   out: T (beta v)
    w_ref,  # [C, dk] f32   out: T (beta exp(G) k)
    gcum_ref,  # [C] f32    out: G = cumsum(g) within the chunk
    *,
    f32_dots: str,
):
    n = gcum_ref.shape[0]
    start = pl.program_id(2) * n
    n_live = jnp.minimum(valid_ref[0], k_ref.shape[0])

    @pl.when(start < n_live)  # a chunk past num_valid is never read by the later kernels
    def _():
        live = start + jnp.arange(n) < n_live
        k, v = _load_rows(k_ref, start, live), _load_rows(v_ref, start, live)
        G = jnp.cumsum(_load_rows(g_ref, start, live).astype(F32))  # <= 0, non-increasing
        beta = _load_rows(beta_ref, start, live).astype(F32)
        u_ref[...], w_ref[...] = _intra_chunk(k, v, G, beta, functools.partial(_dot, f32_dots=f32_dots))
        gcum_ref[...] = G


def _state_pass_kernel(
    k_ref,  # [T, dk]     keys, key head h // r
    u_ref,  # [Tp, BV] f32  from the intra-chunk kernel, this V-block
    w_ref,  # [Tp, dk] f32
    gcum_ref,  # [Tp] f32
    pool_ref,  # [S, dk, BV] state pool as read (this head, this V-block)
    read_ref,  # [1] int32
    write_ref,  # [1] int32
    has_ref,  # [1] int32
    valid_ref,  # [1] int32
    vnew_ref,  # [Tp, BV] f32  out: v_new of every live chunk
    hs_ref,  # [chunks, dk, BV] f32  out: the state entering every live chunk
    pool_out_ref,  # [S, dk, BV] the same pool buffer (aliased), receives the final state
    *,
    chunk_size: int,
    barrier: bool,
    f32_dots: str,
):
    """The sequential part alone: v_new and the state entering each chunk, for `_output_kernel`."""
    seq_len, n = k_ref.shape[0], chunk_size
    dot = functools.partial(_dot, f32_dots=f32_dots)
    n_live = jnp.minimum(valid_ref[0], seq_len)
    h = jnp.where(has_ref[0] != 0, pool_ref[read_ref[0]].astype(F32), 0.0)  # [dk, BV]
    if barrier:  # the start tile is in registers before the final state is stored
        pltriton.debug_barrier()

    def chunk(c, h):
        start = c * n
        live = start + jnp.arange(n) < n_live
        k = _load_rows(k_ref, start, live)
        u, w = u_ref[pl.ds(start, n)], w_ref[pl.ds(start, n)]  # [C, BV], [C, dk]
        G = gcum_ref[pl.ds(start, n)]  # [C]
        g_last = gcum_ref[start + n - 1]
        hs_ref[c] = h
        v_new = u - dot(w, h)  # [C, BV] corrected values
        vnew_ref[pl.ds(start, n)] = v_new
        k_dec = jnp.exp(g_last - G)[:, None] * k.astype(F32)  # [C, dk]
        return jnp.exp(g_last) * h + dot(k_dec, v_new, trans_a=True)

    h = lax.fori_loop(0, pl.cdiv(n_live, n), chunk, h)
    pool_out_ref[write_ref[0]] = h.astype(pool_out_ref.dtype)


def _output_kernel(
    q_ref,  # [T, dk]     queries, key head h // r (normalised, scaled)
    k_ref,  # [T, dk]     keys
    vnew_ref,  # [Tp, BV] f32
    hs_ref,  # [chunks, dk, BV] f32
    gcum_ref,  # [Tp] f32
    valid_ref,  # [1] int32
    o_ref,  # [T, BV] f32
    *,
    chunk_size: int,
    f32_dots: str,
):
    """o of one chunk, all chunks in parallel: (exp(G) q) h_c + (q k^T * Gamma) v_new."""
    seq_len, n = q_ref.shape[0], chunk_size
    c = pl.program_id(3)
    start = c * n
    n_live = jnp.minimum(valid_ref[0], seq_len)
    in_bounds = (start + jnp.arange(n) < seq_len)[:, None]  # rows of this chunk that exist in o

    @pl.when(start < n_live)
    def _():
        dot = functools.partial(_dot, f32_dots=f32_dots)
        live = start + jnp.arange(n) < n_live
        q, k = _load_rows(q_ref, start, live), _load_rows(k_ref, start, live)  # [C, dk]
        G = gcum_ref[pl.ds(start, n)]  # [C]
        attn = dot(q, k, trans_b=True) * _decay(G, strict=False)  # [C, C]
        o = dot(jnp.exp(G)[:, None] * q.astype(F32), hs_ref[c]) + dot(attn, vnew_ref[pl.ds(start, n)])
        pltriton.store(o_ref.at[pl.ds(start, n)], o.astype(o_ref.dtype), mask=in_bounds)

    @pl.when(start >= n_live)  # chunks past num_valid read out 0 (the reference zeroes their q)
    def _():
        pltriton.store(o_ref.at[pl.ds(start, n)], jnp.zeros((n, o_ref.shape[1]), o_ref.dtype), mask=in_bounds)


# V-block of the state pass and the output kernel: 64 columns once the state pass has at least one
# program per SM at that width, else 32. Measured on one H200 (chunk 64, tf32x3, 2 stages; docs/
# benchmarks.md "GDN chunked prefill"): B 8 x T 512 at 16 / 48 value heads 64 columns 760 / 2135 us
# busy against 1041 / 2865 at 32; B 1 x T 4096, 16 heads: 32 columns 1301 us against 1366 at 64.
WIDE_BLOCK_V = 64


def default_block_v(b: int, hv: int, dv: int, sm_count: int | None = None) -> int:
    """V-block width for b requests of hv value heads with dv columns each."""
    if dv % WIDE_BLOCK_V == 0 and b * hv * (dv // WIDE_BLOCK_V) >= (sm_count or device_sm_count()):
        return WIDE_BLOCK_V
    return min(32, dv)


def default_num_stages(block_v: int) -> int:
    """Triton pipeline stages of the state pass and the output kernel: 2, or 1 past WIDE_BLOCK_V
    columns, where two stages of the state pass's tiles overflow an H200's 227 KiB of shared memory
    (246 KB at 128 columns)."""
    return 2 if block_v <= WIDE_BLOCK_V else 1


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


def _intra_chunk_call(k, v, g, beta, num_valid, *, chunk_size, hv, interpret, num_warps, f32_dots):
    """u [B, HV, Tp, dv], w [B, HV, Tp, dk], G [B, HV, Tp] (float32, Tp = chunks * C)."""
    b, t, hk, dk = k.shape
    dv, r = v.shape[3], hv // hk
    n_chunks = pl.cdiv(t, chunk_size)
    tp = n_chunks * chunk_size
    call = pl.pallas_call(
        functools.partial(_intra_chunk_kernel, f32_dots=f32_dots),
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
    num_stages: int | None = None,
    f32_dots: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Pallas chunked GDN prefill; same contract as `reference.gdn_prefill`.

    Returns o [B, T, HV, dv] float32 and the pool with pool[write_idx[b]] = the state after the
    last valid token. T need not be a multiple of `chunk_size` (a power of two >= 16). `block_v`
    (power of two >= 16 dividing dv; default `default_block_v`) is the V-block of the state pass
    and the output kernel; `num_stages` their Triton pipeline depth (default `default_num_stages`).
    `f32_dots` (F32_DOTS; default `default_f32_dots(v.dtype)`) is how the float32 dots run when
    compiled; interpreted, the TF32 modes are IEEE. With
    duplicate write slots (padding rows write the null slot 0) slot 0 holds any one of them.
    """
    b, t, hk, dk = q.shape
    hv, dv = v.shape[2:]
    block_v = block_v or default_block_v(b, hv, dv)
    num_stages = num_stages or default_num_stages(block_v)
    _check(q, v, pool, chunk_size, block_v)
    f32_dots = f32_dots or default_f32_dots(v.dtype)
    if f32_dots not in F32_DOTS:
        raise ValueError(f"{f32_dots=} must be one of {F32_DOTS}")
    f32_dots = "ieee" if interpret and f32_dots in _TF32_ALGORITHMS else f32_dots
    i32 = jnp.int32
    num_valid = num_valid.astype(i32)
    r, n_slots = hv // hk, pool.shape[0]
    with ignore_triton_deprecation():
        u, w, gcum = _intra_chunk_call(k, v, g, beta, num_valid, chunk_size=chunk_size, hv=hv, interpret=interpret,
                                       num_warps=num_warps, f32_dots=f32_dots)
        tp = u.shape[2]
        n_chunks = tp // chunk_size
        key_spec = pl.BlockSpec((None, t, None, dk), lambda i, h, j, *_: (i, 0, h // r, 0))
        pool_spec = pl.BlockSpec((n_slots, None, dk, block_v), lambda i, h, j: (0, h, 0, j))
        scalar_spec = pl.BlockSpec((1,), lambda i, h, j, *_: (i,))
        rows_spec = pl.BlockSpec((None, None, tp, block_v), lambda i, h, j, *_: (i, h, 0, j))  # u, v_new
        gcum_spec = pl.BlockSpec((None, None, tp), lambda i, h, j, *_: (i, h, 0))
        states_spec = pl.BlockSpec((None, None, n_chunks, dk, block_v), lambda i, h, j, *_: (i, h, 0, 0, j))
        kernel_args = dict(chunk_size=chunk_size, f32_dots=f32_dots)
        params = triton_compiler_params(num_warps, num_stages=num_stages)
        state_call = pl.pallas_call(
            functools.partial(_state_pass_kernel, barrier=not interpret, **kernel_args),
            grid=(b, hv, dv // block_v),
            in_specs=[key_spec, rows_spec, pl.BlockSpec((None, None, tp, dk), lambda i, h, j: (i, h, 0, 0)),
                      gcum_spec, pool_spec, *[scalar_spec] * 4],
            out_specs=[rows_spec, states_spec, pool_spec],
            out_shape=[jax.ShapeDtypeStruct((b, hv, tp, dv), F32), jax.ShapeDtypeStruct((b, hv, n_chunks, dk, dv), F32),
                       jax.ShapeDtypeStruct(pool.shape, pool.dtype)],
            input_output_aliases={4: 2},
            compiler_params=params,
            interpret=interpret,
            name="gdn_chunk_state_pass",
        )
        v_new, states, pool = state_call(k, u, w, gcum, pool, read_idx.astype(i32), write_idx.astype(i32),
                                         has_state.astype(i32), num_valid)
        out_call = pl.pallas_call(
            functools.partial(_output_kernel, **kernel_args),
            grid=(b, hv, dv // block_v, n_chunks),
            in_specs=[key_spec, key_spec, rows_spec, states_spec, gcum_spec, scalar_spec],
            out_specs=pl.BlockSpec((None, t, None, block_v), lambda i, h, j, c: (i, 0, h, j)),
            out_shape=jax.ShapeDtypeStruct((b, t, hv, dv), F32),
            compiler_params=params,
            interpret=interpret,
            name="gdn_chunk_output",
        )
        return out_call(q, k, v_new, states, gcum, num_valid), pool
