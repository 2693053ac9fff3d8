"""QK-norm + RoPE + KV write in one kernel (Pallas, Triton lowering): the glue between an attention
layer's q / k / v projection and the span attention.

Same semantics as `reference.qk_norm_rope_write`. Where XLA ran this glue as five to six small
kernels per layer (the q and k norms with RoPE, the two K / V scatters, and a concatenation it
materialised for the attention call's RoPE'd q; docs/benchmarks.md, "Kernels per layer"), this is
one launch. One program per (span token, kv head): it reads the token's row of the merged
projection output (no slice of it is copied), normalises and rotates the kv head's G = nH // nKV
query heads and its key, stores the queries unpacked (`[R * T * nH, D]` rows, what the attention
kernel reads) and writes the key and value into the token's page slot in place (the pools are
aliased to the outputs).

Rounding follows the reference step by step (norm in float32, rounded to the activation dtype, scaled
by the weight; RoPE terms each rounded to that dtype) so a bfloat16 model computes the same values
up to the order of the norm's sum. RoPE rotates halves of the first `rotary_dim` columns: every
column c is paired with its partner (c +- rotary_dim / 2), loaded as a second gather of the same
row, and columns past `rotary_dim` pass through (cos 1, sin 0). Head dims and GQA groups that are
not powers of two are padded inside with masked loads and stores.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.attention.reference import rope_inv_freq
from pallas_kernels.triton_common import ignore_triton_deprecation, triton_compiler_params

F32 = jnp.float32


def _prologue_kernel(
    qkv_ref,  # [R * T, C]                   the merged projection, one row per span token
    qn_ref,  # [D]                           q norm weight (ones when there is no norm)
    kn_ref,  # [D]                           k norm weight
    freq_ref,  # [D] float32                 inverse frequency of each column's pair (0 past rotary_dim)
    bt_ref,  # [R, P] int32                  block tables
    start_ref,  # [R] int32
    valid_ref,  # [R] int32
    kp_in,  # [N * page_size, nKV * D]      aliased to kp_ref
    vp_in,  # [N * page_size, nKV * D]      aliased to vp_ref
    q_ref,  # [R * T * nH, D]               out: normalised, rotated queries
    kp_ref,  # [N * page_size, nKV * D]     out: K pool, this token's slot written
    vp_ref,  # [N * page_size, nKV * D]     out: V pool
    *,
    span: int,
    group: int,
    head_dim: int,
    q_stride: int,
    page_size: int,
    rotary_dim: int,
    eps: float,
    zero_centered: bool,
    normalize: bool,
    norm_dtype,
):
    del kp_in, vp_in
    token, kv_head = pl.program_id(0), pl.program_id(1)
    r, t = token // span, token % span
    pos = start_ref[r] + t
    n_kv = kp_ref.shape[1] // head_dim
    dp, gp = pl.next_power_of_2(head_dim), pl.next_power_of_2(group)

    col = jnp.arange(dp, dtype=jnp.int32)
    d_ok = col < head_dim
    half = rotary_dim // 2
    partner = jnp.where(col < half, col + half, jnp.where(col < rotary_dim, col - half, col))
    sign = jnp.where(col < half, -1.0, 1.0).astype(F32)
    angle = pos.astype(F32) * pltriton.load(freq_ref.at[col], mask=d_ok, other=0.0)  # [Dp]
    in_rot = col < rotary_dim
    cos = jnp.where(in_rot, jnp.cos(angle), 1.0).astype(norm_dtype).astype(F32)
    sin = jnp.where(in_rot, jnp.sin(angle), 0.0).astype(norm_dtype).astype(F32)

    # Every load is issued before the first store (Triton keeps loads after a store that may alias).
    def weights(ref):  # -> the norm weight at each column and at its partner, float32 [Dp]
        return (pltriton.load(ref.at[col], mask=d_ok, other=0.0).astype(F32),
                pltriton.load(ref.at[partner], mask=d_ok, other=0.0).astype(F32))

    def row_pair(rows, first_col, mask):  # rows [n] of qkv from columns first_col [n] -> x, partner x [n, Dp]
        at = lambda c: qkv_ref.at[rows[:, None], first_col[:, None] + c[None, :]]  # noqa: E731
        return pltriton.load(at(col), mask=mask, other=0.0), pltriton.load(at(partner), mask=mask, other=0.0)

    g = jnp.arange(gp, dtype=jnp.int32)
    one = jnp.zeros((1,), jnp.int32)
    q_head = kv_head * group + g  # [Gp]
    q_mask = (g < group)[:, None] & d_ok[None, :]
    q_pair = row_pair(token + 0 * g, q_head * q_stride, q_mask)
    k_col = n_kv * group * q_stride + kv_head * head_dim
    k_pair = row_pair(token + one, k_col + one, d_ok[None, :])
    v = pltriton.load(qkv_ref.at[token + one[:, None], (k_col + n_kv * head_dim + col)[None, :]],
                      mask=d_ok[None, :], other=0.0)
    w_q, w_k = (weights(qn_ref), weights(kn_ref)) if normalize else (None, None)
    # Slot of this token; a padding token (t >= num_valid) writes nothing.
    slot = jnp.minimum(pos // page_size, bt_ref.shape[1] - 1)
    valid = t < valid_ref[r]
    pool_row = jnp.where(valid, bt_ref[r, slot] * page_size + pos % page_size, kp_ref.shape[0])

    def norm_rope(pair, w):  # x and its partner columns [n, Dp] -> normalised, rotated x, float32
        x, xp = pair
        x_dtype = x.dtype
        x, xp = x.astype(F32), xp.astype(F32)
        if normalize:
            w, wp = w
            inv = jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) / head_dim + eps)
            if zero_centered:
                x, xp = x * inv * (1.0 + w[None, :]), xp * inv * (1.0 + wp[None, :])
            else:
                x = (x * inv).astype(x_dtype).astype(F32) * w[None, :]
                xp = (xp * inv).astype(x_dtype).astype(F32) * wp[None, :]
            x, xp = x.astype(norm_dtype).astype(F32), xp.astype(norm_dtype).astype(F32)
        a = (x * cos[None, :]).astype(norm_dtype).astype(F32)
        b = (sign[None, :] * xp * sin[None, :]).astype(norm_dtype).astype(F32)
        return a + b

    q, k = norm_rope(q_pair, w_q), norm_rope(k_pair, w_k)
    # Rows past the group point one past the end (masked: never written; the interpreter drops them).
    out_rows = jnp.where(g < group, token * (n_kv * group) + q_head, q_ref.shape[0])
    pltriton.store(q_ref.at[out_rows[:, None], col[None, :]], q.astype(q_ref.dtype), mask=q_mask)
    write = valid & d_ok[None, :]
    rows, cols = pool_row + one[:, None], (kv_head * head_dim + col)[None, :]
    pltriton.store(kp_ref.at[rows, cols], k.astype(kp_ref.dtype), mask=write)
    pltriton.store(vp_ref.at[rows, cols], v.astype(vp_ref.dtype), mask=write)


def qk_norm_rope_write_pallas(
    qkv: jax.Array,  # [R, T, nH * q_stride + 2 * nKV * D]
    q_norm: jax.Array | None,  # [D] or None
    k_norm: jax.Array | None,  # [D] or None
    k_pages: jax.Array,  # [N, page_size, nKV, D]
    v_pages: jax.Array,  # [N, page_size, nKV, D]
    block_tables: jax.Array,  # [R, P] int32
    start_pos: jax.Array,  # [R] int32
    num_valid: jax.Array,  # [R] int32
    *,
    n_heads: int,
    q_stride: int,
    eps: float,
    zero_centered: bool,
    theta: float,
    rotary_dim: int,
    interpret: bool = False,
    num_warps: int | None = None,
):
    """Pallas form of `reference.qk_norm_rope_write`: `(q [R, T, nH, D], k_pages, v_pages)`, the
    pools updated in place (donate them at the jit boundary or XLA copies them first)."""
    r, span, width = qkv.shape
    n_pages, page_size, n_kv, head_dim = k_pages.shape
    if n_heads % n_kv:
        raise ValueError(f"{n_heads=} must be a multiple of the cache's kv heads {n_kv}")
    if width < n_heads * q_stride + 2 * n_kv * head_dim or q_stride < head_dim:
        raise ValueError(f"qkv width {width} with {q_stride=} does not hold {n_heads} query heads and 2 x {n_kv} "
                         f"kv heads of {head_dim=}")
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"{rotary_dim=} must be even and in (0, {head_dim=}]")
    normalize = q_norm is not None
    # The dtype the reference's rms_norm returns (and RoPE then keeps).
    norm_dtype = jnp.result_type(q_norm.dtype, qkv.dtype) if normalize and not zero_centered else qkv.dtype
    if not normalize:
        q_norm = k_norm = jnp.ones((head_dim,), qkv.dtype)
    freq = rope_inv_freq(theta, rotary_dim)
    freq = jnp.pad(jnp.concatenate([freq, freq]), (0, head_dim - rotary_dim))  # [D] pair frequency per column
    pool = (n_pages * page_size, n_kv * head_dim)
    if num_warps is None:  # a warp per 256 elements of the query tile, 1 to 4
        tile = pl.next_power_of_2(n_heads // n_kv) * pl.next_power_of_2(head_dim)
        num_warps = max(1, min(4, tile // 256))
    kernel = functools.partial(
        _prologue_kernel, span=span, group=n_heads // n_kv, head_dim=head_dim, q_stride=q_stride,
        page_size=page_size, rotary_dim=rotary_dim, eps=eps, zero_centered=zero_centered, normalize=normalize,
        norm_dtype=norm_dtype)
    whole = lambda *shape: pl.BlockSpec(shape, lambda i, h: (0,) * len(shape))  # noqa: E731
    q_rows = jax.ShapeDtypeStruct((r * span * n_heads, head_dim), norm_dtype)
    call = pl.pallas_call(
        kernel,
        grid=(r * span, n_kv),
        in_specs=[whole(r * span, width), whole(head_dim), whole(head_dim), whole(head_dim),
                  whole(*block_tables.shape), whole(r), whole(r), whole(*pool), whole(*pool)],
        out_specs=[whole(*q_rows.shape), whole(*pool), whole(*pool)],
        out_shape=[q_rows, jax.ShapeDtypeStruct(pool, k_pages.dtype), jax.ShapeDtypeStruct(pool, v_pages.dtype)],
        input_output_aliases={7: 1, 8: 2},
        compiler_params=triton_compiler_params(num_warps, num_stages=1),
        interpret=interpret,
        name="qk_norm_rope_write",
    )
    with ignore_triton_deprecation():
        q, k_out, v_out = call(qkv.reshape(r * span, width), q_norm, k_norm, freq, block_tables.astype(jnp.int32),
                               start_pos.astype(jnp.int32), num_valid.astype(jnp.int32), k_pages.reshape(pool),
                               v_pages.reshape(pool))
    return q.reshape(r, span, n_heads, head_dim), k_out.reshape(k_pages.shape), v_out.reshape(v_pages.shape)
