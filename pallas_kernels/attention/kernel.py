"""Paged attention over a 1+k query span: Pallas kernel (Triton lowering), split-KV flash decoding.

Same semantics as `reference.paged_attention`. One program per (request, kv head, KV split). The
span's T query tokens times the GQA group's G = nH // nKV query heads share one kv head, so they
are packed into one block of `M = pad16(T * G)` rows (row i = token i // G, head i % G), gathered
by the kernel from q as it is (`[R * T * nH, D]`, a free reshape), and each K/V block is read once
for all of them. A request's keys are cut into blocks of
`pages_per_block * page_size` keys, and its live blocks (up to start_pos + num_valid, known only
at run time) are shared out evenly between the `num_splits` programs of that (request, kv head):
at batch 1 a 512-token context then runs on dozens of programs instead of nKV. Each program runs
an online softmax in float32 over its blocks and writes its partial result: the running max m,
the sum l of exp(s - m) and the unnormalised accumulator acc = sum exp(s - m) v. A second kernel
(`_merge_kernel`, whose XLA form is `combine_splits`) merges them, rescaling each split by
exp(m_split - m_max), and stores each row straight to its place in the `[R, T, nH, D]` output. A
split with no live block writes m = MASK_VALUE, l = 0, acc = 0 and drops out of the merge. With
`num_splits = 1` the program normalises and stores the output itself (no partials, no merge): the
one-pass kernel.

The causal mask is per row (row i sees keys `<= start_pos + i // G`). Head dims that are not a
power of two (Triton tensor sizes) are zero-padded to `Dp` on load inside the kernel (masked loads
of q, K and V; the cache stays unpadded and no page is copied). Zero columns of q and k leave q.k
unchanged, zero columns of v give zero output columns, which are never stored.
The pools are read through a free reshape to `[N * page_size, nKV * D]`: key rows are gathered by
index (block table -> row), the kv head is a column offset.

Triton constraints honoured here: every tensor has power-of-two dims (M, Dp, block keys), dot
operands are >= 16 on every side, shapes are static and everything per request (start_pos,
num_valid, block table) is read from refs at run time.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.attention.reference import MASK_VALUE
from pallas_kernels.triton_common import (
    MIN_DOT,
    device_sm_count,
    dot,
    ignore_triton_deprecation,
    is_pow2,
    pow2_at_least,
    triton_compiler_params,
)


def padded_head_dim(d: int) -> int:
    """The head dim the kernel computes with: the next power of two, at least MIN_DOT."""
    return pow2_at_least(d)


def _split_range(n_blocks, split, num_splits: int):
    """Blocks `[first, last)` of this split: the live blocks shared out evenly, in order."""
    per_split = pl.cdiv(n_blocks, num_splits)
    first = split * per_split
    return first, jnp.minimum(first + per_split, n_blocks)


def _span_rows(span: int, group: int, n_heads: int, m_rows: int, n_rows: int):
    """Rows of q / o flattened to `[n_rows = R * T * nH, D]` that the packed rows of program
    (request i, kv head h) stand for (packed row j = token j // G, head h * G + j % G), and which
    packed rows are real. The rest pad M up to a power of two: they point one past the end (masked,
    so never read or written; the interpreter drops such a scatter, where a clamped index would
    write a stale row over a real one) and read zeros."""
    row = jnp.arange(m_rows, dtype=jnp.int32)
    real = row < span * group
    flat = (pl.program_id(0) * span + row // group) * n_heads + pl.program_id(1) * group + row % group
    return jnp.where(real, flat, n_rows), real


def _attention_kernel(
    q_ref,  # [R * T * nH, D]             the span's queries, unpacked (a free reshape of q)
    k_ref,  # [N * page_size, nKV * D]    the whole K pool, one row per cached token
    v_ref,  # [N * page_size, nKV * D]    the whole V pool
    bt_ref,  # [P_pad] int32              this request's block table
    start_ref,  # [1] int32               start_pos of this request
    valid_ref,  # [1] int32               num_valid of this request
    *out_refs,  # one pass: o [R * T * nH, D] (unpacked); split: acc [M, Dp] f32, m [M] f32, l [M] f32
    group: int,
    span: int,
    head_dim: int,
    m_rows: int,
    n_heads: int,
    page_size: int,
    pages_per_block: int,
    num_splits: int,
    scale: float,
):
    dp = padded_head_dim(head_dim)
    block_k = pages_per_block * page_size
    start, n_valid = start_ref[0], valid_ref[0]

    row = jnp.arange(m_rows, dtype=jnp.int32)
    row_pos = start + row // group  # [M] absolute position of each row's token
    row_ok = (row < span * group) & (row // group < n_valid)  # [M] pad rows/tokens are inert
    # Keys needed: positions < start + num_valid; a padding row (num_valid = 0) has no live block.
    kv_len = jnp.where(n_valid > 0, start + n_valid, 0)
    n_slots = bt_ref.shape[0]
    n_blocks = jnp.minimum(pl.cdiv(kv_len, block_k), pl.cdiv(n_slots, pages_per_block))
    first, last = _split_range(n_blocks, pl.program_id(2), num_splits)

    key = jnp.arange(block_k, dtype=jnp.int32)
    col = jnp.arange(dp, dtype=jnp.int32)
    cols = pl.program_id(1) * head_dim + col  # [Dp] this kv head's columns (past D: masked)

    def load(ref, rows):  # rows [block_k] of the pool, this kv head's columns -> [block_k, Dp]
        if dp == head_dim:
            return ref[rows[:, None], cols[None, :]]
        return pltriton.load(ref.at[rows[:, None], cols[None, :]], mask=(col < head_dim)[None, :], other=0.0)

    q_rows, real = _span_rows(span, group, n_heads, m_rows, q_ref.shape[0])
    d_ok = (col < head_dim)[None, :]
    q = pltriton.load(q_ref.at[q_rows[:, None], col[None, :]], mask=real[:, None] & d_ok, other=0.0)  # [M, Dp]

    def body(j, carry):
        acc, m_prev, l_prev = carry  # [M, Dp], [M], [M] float32
        # Pool rows of keys j * block_k .. + block_k of this request (block table -> page -> row).
        # A last block reaching past the table's width reads the null page there (keys past kv_len:
        # masked), so the table is never padded to whole blocks.
        slot = j * pages_per_block + key // page_size
        if n_slots % pages_per_block:
            page = pltriton.load(bt_ref.at[slot], mask=slot < n_slots, other=0)
        else:
            page = bt_ref[slot]
        rows = page * page_size + key % page_size
        k, v = load(k_ref, rows), load(v_ref, rows)
        s = dot(q, k, contract_b=1) * scale  # q k^T: [M, block_k] float32
        mask = ((j * block_k + key)[None, :] <= row_pos[:, None]) & row_ok[:, None]
        s = jnp.where(mask, s, MASK_VALUE)
        # Online softmax: m = running max, l = running sum of exp(s - m), acc = sum exp(s - m) v.
        m_new = jnp.maximum(m_prev, s.max(axis=-1))
        p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
        correction = jnp.exp(m_prev - m_new)
        l_new = correction * l_prev + p.sum(axis=-1)
        acc = correction[:, None] * acc + dot(p.astype(v.dtype), v, contract_b=0)
        return acc, m_new, l_new

    init = (
        jnp.zeros((m_rows, dp), jnp.float32),
        jnp.full((m_rows,), MASK_VALUE, jnp.float32),
        jnp.zeros((m_rows,), jnp.float32),
    )
    acc, m, denom = jax.lax.fori_loop(first, last, body, init)
    if num_splits == 1:
        (o_ref,) = out_refs
        # Rows that saw no key (inert rows) have denom = 0 and acc = 0: write zeros, not NaN.
        o = (acc / jnp.where(denom > 0, denom, 1.0)[:, None]).astype(o_ref.dtype)
        pltriton.store(o_ref.at[q_rows[:, None], col[None, :]], o, mask=real[:, None] & d_ok)
    else:
        acc_ref, m_ref, l_ref = out_refs
        acc_ref[...] = acc
        m_ref[...] = m
        l_ref[...] = denom


def combine_splits(
    acc: jax.Array,  # [..., S, M, Dp] float32 unnormalised accumulators of the S splits
    m: jax.Array,  # [..., S, M] float32 running maxima (MASK_VALUE: the split saw no key)
    denom: jax.Array,  # [..., S, M] float32 sums of exp(s - m)
) -> jax.Array:
    """Merge split-KV partials -> `[..., M, Dp]` float32: sum_s w_s acc_s / sum_s w_s l_s with
    w_s = exp(m_s - max_s m_s). Rows no split saw (all l = 0) come out as zeros, never NaN."""
    w = jnp.exp(m - m.max(axis=-2, keepdims=True))  # [..., S, M]; empty splits: acc = l = 0
    total = (w * denom).sum(axis=-2)  # [..., M]
    out = (w[..., None] * acc).sum(axis=-3)  # [..., M, Dp]
    return out / jnp.where(total > 0, total, 1.0)[..., None]


def _merge_kernel(acc_ref, m_ref, l_ref, o_ref, *, group: int, span: int, head_dim: int, n_heads: int):
    """combine_splits for one (request, kv head) and `block_d` columns, stored straight into the
    unpacked output: acc_ref [S, M, block_d], m_ref / l_ref [S, M], o_ref [R * T * nH, D]."""
    n_splits, m_rows, block_d = acc_ref.shape
    m = m_ref[...]
    w = jnp.exp(m - m.max(axis=0)[None, :])  # [S, M]; empty splits: acc = l = 0
    total = (w * l_ref[...]).sum(axis=0)  # [M]
    out = (w[:, :, None] * acc_ref[...]).sum(axis=0) / jnp.where(total > 0, total, 1.0)[:, None]  # [M, block_d]
    rows, real = _span_rows(span, group, n_heads, m_rows, o_ref.shape[0])
    cols = pl.program_id(2) * block_d + jnp.arange(block_d, dtype=jnp.int32)
    pltriton.store(o_ref.at[rows[:, None], cols[None, :]], out.astype(o_ref.dtype),
                   mask=real[:, None] & (cols < head_dim)[None, :])


# Elements of one merge program's [S, M, block_d] float32 tile (16 KiB): block_d shrinks as the
# splits and rows grow, so the tile stays in registers.
MERGE_TILE = 4096


def _merge_splits(partials, out_shape, *, group, span, head_dim, interpret, num_warps):
    """The split partials [R, nKV, S, M, Dp] (S a power of two) -> the output [R * T * nH, D] in
    one launch (the XLA form of combine_splits, a transpose and a slice took three)."""
    acc, m, denom = partials
    r, nkv, n_splits, m_rows, dp = acc.shape
    block_d = min(dp, max(1, pl.next_power_of_2(MERGE_TILE // (n_splits * m_rows) + 1) // 2))
    tile = pl.BlockSpec((None, None, n_splits, m_rows), lambda i, h, c: (i, h, 0, 0))
    call = pl.pallas_call(
        functools.partial(_merge_kernel, group=group, span=span, head_dim=head_dim, n_heads=nkv * group),
        grid=(r, nkv, dp // block_d),
        in_specs=[pl.BlockSpec((None, None, n_splits, m_rows, block_d), lambda i, h, c: (i, h, 0, 0, c)), tile, tile],
        out_specs=pl.BlockSpec(out_shape.shape, lambda i, h, c: (0, 0)),
        out_shape=out_shape,
        compiler_params=triton_compiler_params(num_warps, num_stages=1),
        interpret=interpret,
        name="paged_span_attention_merge",
    )
    return call(acc, m, denom)


def _check_shapes(q, k_pages, pages_per_block):
    nh = q.shape[2]
    _, page_size, nkv, _ = k_pages.shape
    if nh % nkv:
        raise ValueError(f"{nh=} must be a multiple of {nkv=}")
    for name, n in (("page_size", page_size), ("pages_per_block", pages_per_block)):
        if not is_pow2(n):
            raise ValueError(f"{name}={n} must be a power of two (Triton tensor sizes)")
    if pages_per_block * page_size < MIN_DOT:
        raise ValueError(f"{pages_per_block=} * {page_size=} must be >= {MIN_DOT}")


def default_pages_per_block(page_size: int) -> int:
    """Pages per loop step: 64 keys per block (a good Hopper tile), at least one page."""
    return max(1, 64 // page_size)


# Split the KV until about this many programs per SM are launched, each split holding at least
# one block; more splits only add partials to merge. Measured on one H200 (jax 0.11.2, Qwen3-4B
# heads 32 / 8 x 128, bfloat16, T = 1, us per call with the merge, 8 calls per executable,
# pipelined; a condensed copy of this kernel): batch 1 over 512 / 8k / 32k cached tokens 9.2 /
# 27 / 54 split-KV vs 19 / 230 / 870 one-pass; batch 32 over 512: 28.5 vs 30.6. 32-key blocks
# or 8 warps were no faster.
PROGRAMS_PER_SM = 2
MAX_SPLITS = 64


def default_num_splits(rows: int, nkv: int, n_slots: int, pages_per_block: int, sm_count: int | None = None) -> int:
    """Static KV splits for `rows` requests of `n_slots` block-table slots: enough programs
    (rows * nKV * splits) to fill the GPU about twice over, at most one per block of the longest
    row, rounded down to a power of two."""
    want = pl.cdiv(PROGRAMS_PER_SM * (sm_count or device_sm_count()), rows * nkv)
    return _pow2_floor(max(1, min(want, pl.cdiv(n_slots, pages_per_block), MAX_SPLITS)))


def _pow2_floor(n: int) -> int:
    """The largest power of two <= n (n >= 1): the merge tiles the split axis whole."""
    return 1 << (n.bit_length() - 1)


def paged_attention_pallas(
    q: jax.Array,  # [R, T, nH, D]
    k_pages: jax.Array,  # [N, page_size, nKV, D]
    v_pages: jax.Array,  # [N, page_size, nKV, D]
    block_tables: jax.Array,  # [R, P] int32
    start_pos: jax.Array,  # [R] int32
    num_valid: jax.Array,  # [R] int32
    *,
    scale: float,
    interpret: bool = False,
    num_splits: int | None = None,
    pages_per_block: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> jax.Array:
    """Pallas paged attention; same contract as `reference.paged_attention`.

    Returns `[R, T, nH, D]` in `q.dtype`. `num_splits` (static) is the number of KV splits per
    (request, kv head): None picks `default_num_splits`, 1 is the one-pass kernel (no merge).
    `pages_per_block` (static, power of two) sets how many pages one loop step reads; it defaults
    to 64 keys per step. `interpret=True` runs the kernel body through the Pallas interpreter
    (required on CPU). Any head dim works (padded to a power of two >= 16 inside).
    """
    r, span, nh, d = q.shape
    n_pages, page_size, nkv, _ = k_pages.shape
    pages_per_block = pages_per_block or default_pages_per_block(page_size)
    _check_shapes(q, k_pages, pages_per_block)
    n_slots = block_tables.shape[1]
    num_splits = num_splits or default_num_splits(r, nkv, n_slots, pages_per_block)
    m_rows = max(MIN_DOT, pl.next_power_of_2(span * (nh // nkv)))
    dp = padded_head_dim(d)
    # The partials' split axis is a power of two (the merge takes it whole); programs past
    # num_splits own no block and write empty partials, which merge as nothing.
    grid_splits = pl.next_power_of_2(num_splits)
    kernel = functools.partial(
        _attention_kernel,
        group=nh // nkv,
        span=span,
        head_dim=d,
        m_rows=m_rows,
        n_heads=nh,
        page_size=page_size,
        pages_per_block=pages_per_block,
        num_splits=num_splits,
        scale=scale,
    )
    flat = (n_pages * page_size, nkv * d)
    pool_spec = pl.BlockSpec(flat, lambda i, h, s: (0, 0))
    unpacked = jax.ShapeDtypeStruct((r * span * nh, d), q.dtype)  # q and o as rows, a free reshape
    unpacked_spec = pl.BlockSpec(unpacked.shape, lambda i, h, s: (0, 0))
    if num_splits == 1:
        out_specs = unpacked_spec
        out_shape = unpacked
    else:
        out_specs = [
            pl.BlockSpec((None, None, None, m_rows, dp), lambda i, h, s: (i, h, s, 0, 0)),  # acc
            pl.BlockSpec((None, None, None, m_rows), lambda i, h, s: (i, h, s, 0)),  # m
            pl.BlockSpec((None, None, None, m_rows), lambda i, h, s: (i, h, s, 0)),  # l
        ]
        out_shape = [
            jax.ShapeDtypeStruct((r, nkv, grid_splits, m_rows, dp), jnp.float32),
            jax.ShapeDtypeStruct((r, nkv, grid_splits, m_rows), jnp.float32),
            jax.ShapeDtypeStruct((r, nkv, grid_splits, m_rows), jnp.float32),
        ]
    call = pl.pallas_call(
        kernel,
        grid=(r, nkv, grid_splits),
        in_specs=[
            unpacked_spec,  # q as [R * T * nH, D]
            pool_spec,  # k_pages as [N * page_size, nKV * D]
            pool_spec,  # v_pages
            pl.BlockSpec((None, block_tables.shape[1]), lambda i, h, s: (i, 0)),  # block_tables
            pl.BlockSpec((1,), lambda i, h, s: (i,)),  # start_pos
            pl.BlockSpec((1,), lambda i, h, s: (i,)),  # num_valid
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=triton_compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="paged_span_attention" if num_splits == 1 else "paged_span_attention_split",
    )
    with ignore_triton_deprecation():
        out = call(
            q.reshape(unpacked.shape),
            k_pages.reshape(flat),
            v_pages.reshape(flat),
            block_tables.astype(jnp.int32),
            start_pos.astype(jnp.int32),
            num_valid.astype(jnp.int32),
        )
        if num_splits > 1:
            out = _merge_splits(out, unpacked, group=nh // nkv, span=span, head_dim=d, interpret=interpret,
                                num_warps=num_warps)
    return out.reshape(r, span, nh, d)
