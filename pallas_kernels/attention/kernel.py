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
the sum l of exp(s - m) and the unnormalised accumulator acc = sum exp(s - m) v. The partials are
merged as `combine_splits` does (each split rescaled by exp(m_split - m_max)) and each row is
stored straight to its place in the `[R, T, nH, D]` output, in one of two places
(`default_merge` picks by the partials' size): "fused", inside the same launch by the last program
of each (request, kv head) to finish, which an atomic counter tells (`_fused_merge`); "kernel", by
a second launch (`_merge_kernel`) that spreads the merge over column blocks. A split with no live
block drops out of the merge (m = MASK_VALUE, l = 0, acc = 0). With `num_splits = 1` the program
normalises and stores the output itself (no partials, no merge): the one-pass kernel.

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
    arrived_last,
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
    *refs,  # see below: the outputs, after the counters' input when the merge is fused
    group: int,
    span: int,
    head_dim: int,
    m_rows: int,
    n_heads: int,
    page_size: int,
    pages_per_block: int,
    num_splits: int,
    scale: float,
    merge: str,
    interpret: bool,
):
    """Outputs by path: one pass, o [R * T * nH, D] (unpacked); merge "kernel", this split's
    partials acc [M, Dp], m [M], l [M] (float32); merge "fused", the counters' input (aliased, not
    read) then o, the counters [R * nKV] int32 and the partials of every split as rows
    `[R * nKV * S * Mr (, Dp)]` (`_fused_merge`)."""
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
        (o_ref,) = refs
        # Rows that saw no key (inert rows) have denom = 0 and acc = 0: write zeros, not NaN.
        o = (acc / jnp.where(denom > 0, denom, 1.0)[:, None]).astype(o_ref.dtype)
        pltriton.store(o_ref.at[q_rows[:, None], col[None, :]], o, mask=real[:, None] & d_ok)
    elif merge == "kernel":
        acc_ref, m_ref, l_ref = refs
        acc_ref[...] = acc
        m_ref[...] = m
        l_ref[...] = denom
    else:
        _fused_merge(*refs[1:], (acc, m, denom), first < last, n_blocks, group=group, span=span,
                     head_dim=head_dim, n_heads=n_heads, num_splits=num_splits, barrier=not interpret)


# Elements of the [splits, Mr, Dp] float32 tile that the merging program of the fused merge loads
# at a time (32 KiB: 64 registers a thread at 4 warps).
FUSED_MERGE_TILE = 8192


def _fused_merge(o_ref, count_ref, acc_ref, m_ref, l_ref, partial, live, n_blocks, *, group: int, span: int,
                 head_dim: int, n_heads: int, num_splits: int, barrier: bool):
    """The split-KV merge inside the split kernel: the last program of a (request, kv head) to
    finish merges every split's partials and stores the output, so one launch does it all.

    Each program with live blocks stores its partials (the span's Mr = pow2(T * G) real rows, not
    the M-row tile) to rows `((i * nKV + h) * S + s) * Mr + row`; then every program of the pair,
    live or not, adds one to the pair's counter (`count_ref`, zeros at the launch). The barrier
    before the add orders the whole program's stores before it, and the add is acquire-release at
    GPU scope, so the program that reads S - 1 sees every other split's partials. It merges them as
    `combine_splits` does, loading only the live splits (split s has blocks iff s * per_split <
    n_blocks; the rest never stored)."""
    acc, m, denom = partial
    m_rows, dp = acc.shape
    pair = pl.program_id(0) * pl.num_programs(1) + pl.program_id(1)
    n_splits = pl.num_programs(2)
    real_rows = span * group
    mr = pl.next_power_of_2(real_rows)  # partial rows per split
    row = jnp.arange(m_rows, dtype=jnp.int32)
    col = jnp.arange(dp, dtype=jnp.int32)
    d_ok = (col < head_dim)[None, :]
    n_part = m_ref.shape[0]
    base = pair * n_splits * mr  # first partial row of this (request, kv head)
    mine = jnp.where(row < real_rows, base + pl.program_id(2) * mr + row, n_part)  # pad rows: one past the end
    o_rows, o_real = _span_rows(span, group, n_heads, mr, o_ref.shape[0])  # program ids outside the branches

    @pl.when(live)
    def _store_partials():
        row_ok = row < real_rows
        pltriton.store(acc_ref.at[mine[:, None], col[None, :]], acc, mask=row_ok[:, None] & d_ok)
        pltriton.store(m_ref.at[mine], m, mask=row_ok)
        pltriton.store(l_ref.at[mine], denom, mask=row_ok)

    @pl.when(arrived_last(count_ref, pair, n_splits, barrier))
    def _merge():
        # combine_splits over the live splits: the maxima first, then the accumulators in chunks
        # whose loads do not wait on each other (an online merge over chunks measured slower).
        per_split = pl.cdiv(n_blocks, num_splits)
        r = jnp.arange(mr, dtype=jnp.int32)

        def live_rows(s):  # partial rows [len(s), Mr] of splits s, and which hold a live split's real row
            return base + s[:, None] * mr + r[None, :], (s * per_split < n_blocks)[:, None] & (r < real_rows)[None, :]

        rows, ok = live_rows(jnp.arange(n_splits, dtype=jnp.int32))
        m_max = pltriton.load(m_ref.at[rows], mask=ok, other=MASK_VALUE).max(axis=0)  # [Mr]
        chunk = max(1, min(n_splits, FUSED_MERGE_TILE // (mr * dp)))
        total = jnp.zeros((mr,), jnp.float32)
        out = jnp.zeros((mr, dp), jnp.float32)
        for c in range(n_splits // chunk):
            rows, ok = live_rows(c * chunk + jnp.arange(chunk, dtype=jnp.int32))
            w = jnp.where(ok, jnp.exp(pltriton.load(m_ref.at[rows], mask=ok, other=MASK_VALUE) - m_max[None, :]), 0.0)
            total = total + (w * pltriton.load(l_ref.at[rows], mask=ok, other=0.0)).sum(axis=0)
            acc_c = pltriton.load(acc_ref.at[rows[:, :, None], col[None, None, :]], mask=ok[:, :, None] & d_ok[None],
                                  other=0.0)
            out = out + (w[:, :, None] * acc_c).sum(axis=0)
        out = out / jnp.where(total > 0, total, 1.0)[:, None]
        pltriton.store(o_ref.at[o_rows[:, None], col[None, :]], out.astype(o_ref.dtype),
                       mask=o_real[:, None] & d_ok)


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


MERGES = ("fused", "kernel")
# The fused merge's last program reads every split's partials alone, while the merge kernel spreads
# them over (request, kv head, column block) programs: fused wins while the partials of one (request,
# kv head) are small. Measured on one H100 (jax 0.11.2, bfloat16, batch 1, us of GPU time per call,
# fused / kernel at the same splits): Qwen3-4B heads, T = 1 (32 splits x 4 rows x 128 = 16K
# elements) 18.9 / 20.3 at 8k cached tokens, 50.3 / 52.3 at 32k; Qwen3.5-2B heads, T = 1 (64 x 4 x
# 256 = 64K) 15.6 / 15.0 at 8k; Qwen3-4B heads, T = 8 (32 x 32 x 128 = 128K, a merge variant that
# rescaled chunk by chunk) 63.6 / 25.9. docs/benchmarks.md has the tables.
FUSED_MERGE_MAX = 16384


def default_merge(num_splits: int, span: int, group: int, head_dim: int) -> str:
    """Where the KV splits merge: "fused" while one (request, kv head)'s partials (splits x
    pow2(T * G) rows x padded head dim) hold at most FUSED_MERGE_MAX elements, else "kernel"."""
    elements = pl.next_power_of_2(num_splits) * pl.next_power_of_2(span * group) * padded_head_dim(head_dim)
    return "fused" if elements <= FUSED_MERGE_MAX else "kernel"


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
    merge: str | None = None,
) -> jax.Array:
    """Pallas paged attention; same contract as `reference.paged_attention`.

    Returns `[R, T, nH, D]` in `q.dtype`. `num_splits` (static) is the number of KV splits per
    (request, kv head): None picks `default_num_splits`, 1 is the one-pass kernel (no merge).
    `merge` says where the splits are merged: "fused", by the last split of each (request, kv
    head) inside the one launch (`_fused_merge`); "kernel", by a second launch (`_merge_splits`);
    None picks `default_merge`.
    `pages_per_block` (static, power of two) sets how many pages one loop step reads; it defaults
    to 64 keys per step. `interpret=True` runs the kernel body through the Pallas interpreter
    (required on CPU). Any head dim works (padded to a power of two >= 16 inside).
    """
    r, span, nh, d = q.shape
    n_pages, page_size, nkv, _ = k_pages.shape
    pages_per_block = pages_per_block or default_pages_per_block(page_size)
    _check_shapes(q, k_pages, pages_per_block)
    if merge not in (None, *MERGES):
        raise ValueError(f"{merge=} must be one of {MERGES} or None")
    n_slots = block_tables.shape[1]
    num_splits = num_splits or default_num_splits(r, nkv, n_slots, pages_per_block)
    merge = merge or default_merge(num_splits, span, nh // nkv, d)
    m_rows = max(MIN_DOT, pl.next_power_of_2(span * (nh // nkv)))
    dp = padded_head_dim(d)
    # The partials' split axis is a power of two (the merges take it whole); programs past
    # num_splits own no block: empty partials for the merge kernel, skipped by the fused merge.
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
        merge=merge,
        interpret=interpret,
    )
    flat = (n_pages * page_size, nkv * d)
    pool_spec = pl.BlockSpec(flat, lambda i, h, s: (0, 0))
    unpacked = jax.ShapeDtypeStruct((r * span * nh, d), q.dtype)  # q and o as rows, a free reshape
    unpacked_spec = pl.BlockSpec(unpacked.shape, lambda i, h, s: (0, 0))
    in_specs = [
        unpacked_spec,  # q as [R * T * nH, D]
        pool_spec,  # k_pages as [N * page_size, nKV * D]
        pool_spec,  # v_pages
        pl.BlockSpec((None, block_tables.shape[1]), lambda i, h, s: (i, 0)),  # block_tables
        pl.BlockSpec((1,), lambda i, h, s: (i,)),  # start_pos
        pl.BlockSpec((1,), lambda i, h, s: (i,)),  # num_valid
    ]
    args = [
        q.reshape(unpacked.shape),
        k_pages.reshape(flat),
        v_pages.reshape(flat),
        block_tables.astype(jnp.int32),
        start_pos.astype(jnp.int32),
        num_valid.astype(jnp.int32),
    ]
    aliases = {}
    fused = num_splits > 1 and merge == "fused"
    if num_splits == 1:
        out_specs = unpacked_spec
        out_shape = unpacked
    elif fused:
        n_part = r * nkv * grid_splits * pl.next_power_of_2(span * (nh // nkv))  # partial rows
        counters = jax.ShapeDtypeStruct((r * nkv,), jnp.int32)
        whole = lambda shape: pl.BlockSpec(shape, lambda i, h, s: (0,) * len(shape))  # noqa: E731
        in_specs.append(whole(counters.shape))
        args.append(jnp.zeros(counters.shape, counters.dtype))
        aliases = {len(args) - 1: 1}
        out_shape = [
            unpacked,
            counters,
            jax.ShapeDtypeStruct((n_part, dp), jnp.float32),  # acc
            jax.ShapeDtypeStruct((n_part,), jnp.float32),  # m
            jax.ShapeDtypeStruct((n_part,), jnp.float32),  # l
        ]
        out_specs = [whole(o.shape) for o in out_shape]
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
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=triton_compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="paged_span_attention" if num_splits == 1 else "paged_span_attention_split",
    )
    with ignore_triton_deprecation():
        out = call(*args)
        if fused:
            out = out[0]
        elif num_splits > 1:
            out = _merge_splits(out, unpacked, group=nh // nkv, span=span, head_dim=d, interpret=interpret,
                                num_warps=num_warps)
    return out.reshape(r, span, nh, d)
