"""A decoder sublayer's projection with its norm before and its SwiGLU or residual after, in one
Pallas kernel (Triton lowering) for the few rows of a decode or verify step; the contract is
`reference.py`'s.

At a few rows a projection streams its weights once and does almost no arithmetic, and XLA runs
the norm before it and the SwiGLU or residual add after it as kernels of their own, each a launch
of 1-2 us that moves a few KB (docs/benchmarks.md, "Kernels per layer"). Here one program owns a
block of `block_n` output columns for all rows (padded to `block_m` >= 16, a tensor-core dot's
least M; rows past M are masked) and walks K in `block_k` slabs, pipelined by Triton.

The norm folds into that walk. RMSNorm scales each row by r = rsqrt(mean(x^2) + eps) and each
column by the weight g, and a row's scale commutes with the matmul:
norm(x) @ w = r * ((x * g) @ w). So a program multiplies each slab of x by g, accumulates the dot
and the row's sum of squares together, and scales the float32 result by r at the end: no pass over
x before the weights stream, and no normalised copy of x in memory. (The reference rounds norm(x)
to x.dtype before its matmul; here x * g is rounded instead, the same one rounding at another
point.) The GDN's gated output norm (`gate` given) normalises each group of len(norm) channels on
its own, so there a slab is one group and the program applies the reference's norm to it exactly,
gate included, before the dot. With a gate and no norm (gated attention's output gate) each slab of
x is multiplied by the sigmoid of its gate columns, found per channel from (group, pitch). With
`glu` the program reads the gate's and the up projection's column blocks of the packed [gate | up]
weight and stores silu(gate) * up; with a residual it adds the residual's
block, each output rounded to x.dtype where the reference rounds it.

With `splits` > 1 the K slabs are also divided among programs (split-K): program (j, s) walks the
s-th run of slabs of column block j and stores its float32 partial sums (and, for the RMSNorm, the
run's partial sum of squares), and the runs are summed and given the same epilogue either by a
second kernel (`merge="kernel"`) or, in the same launch, by the last program of each column block to
finish, which an atomic counter tells (`merge="fused"`, as the attention kernel's split-KV merge). At
few rows a projection of few column blocks (an output projection of 2048 columns is 32 blocks of
64) otherwise gives each SM one program that walks all of K slab by slab, and a weight stream with
that little in flight runs at a fraction of the bandwidth (docs/benchmarks.md, "Fused projections").

`body` picks how a slab is multiplied. "dot": one tensor-core dot per slab, the rows padded to
`block_m` >= 16. "fma": no tensor cores; every thread keeps float32 products of its share of the
[rows, block_k, block_n] slab and adds each slab's into them, and the K axis is summed once, after
the walk: the rows are padded only to a power of two, and no slab waits on a cross-thread
reduction. At two rows the dot body spends 105-240 registers a thread on 16-row tiles, of which 14
rows are padding, where XLA's gemm streams the same weights with 8-row tiles at 32 registers
(docs/benchmarks.md, "Hardware counters of the decode projections"); the fma body is the lean one
for a decode step's few rows. Its blocks keep `FMA_ACC_PER_THREAD` products a thread
(`fma_block_k`).

K and N need not be powers of two (the tail slab / column block is masked); blocks are.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.linear.reference import output_columns
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

# Rows (M) the kernel takes: one row block of at most this many. Past it a projection has enough
# rows that the gemm is no longer a weight stream, and XLA's gemm runs it (api.py).
MAX_ROWS = 64
# Column blocks: 128 columns for a wide projection (at least WIDE_COLUMNS_PER_SM per SM, so a
# 2048-column one keeps 64), K slabs of 128 rows, and split-K to about one program per SM: the best
# [K, N] configs of the H100 sweep of every Qwen3.5-2B projection at 2 rows (docs/benchmarks.md,
# "Split-K fused projections").
WIDE_BLOCK_N = 128
NARROW_BLOCK_N = 64
WIDE_COLUMNS_PER_SM = 32
BLOCK_K = 128
PROGRAMS_PER_SM = 1
# Shared memory the pipeline's buffers may take (an H200 SM has 227 KiB): with many rows the x slab
# (and the gate's) outweighs the weights', so `pipeline_stages` trims the stages to fit.
SHARED_BYTES = 200 * 1024
BODIES = ("dot", "fma")
MERGES = ("kernel", "fused")
# The fma body's float32 products held per thread: [rows, block_k, block_n] (twice with `glu`) over
# the program's threads; `fma_block_k` sizes the slab to it.
FMA_ACC_PER_THREAD = 32
# The fma body's programs hold few registers and no pipeline buffers, so several share an SM, and
# those programs' loads are what keeps the weight stream in flight: split-K aims at this many an SM.
FMA_PROGRAMS_PER_SM = 8


def block_sizes(rows: int, k_dim: int, n_out: int, itemsize: int, glu: bool = False) -> tuple[int, int, int, int]:
    """(block_m, block_k, block_n, splits): block_m covers the rows (>= 16); block_n is WIDE_BLOCK_N
    columns where N has WIDE_COLUMNS_PER_SM per SM, else NARROW_BLOCK_N (fewer for a narrower N);
    block_k is BLOCK_K (at most K rounded up to a power of two); `split_count` divides the slabs among
    programs."""
    block_m = pow2_at_least(rows)
    wide = n_out >= WIDE_COLUMNS_PER_SM * device_sm_count()
    block_n = WIDE_BLOCK_N if wide else min(NARROW_BLOCK_N, pow2_at_least(n_out))
    block_k = max(MIN_DOT, min(BLOCK_K, pow2_at_least(k_dim)))
    return block_m, block_k, block_n, split_count(rows, k_dim, block_k, -(-n_out // block_n), itemsize)


def split_count(rows: int, k_dim: int, block_k: int, column_blocks: int, itemsize: int,
                per_sm: int = PROGRAMS_PER_SM) -> int:
    """Programs per column block (split-K): the fewest, dividing the K slabs, that give
    `per_sm` programs per SM, and no more than keep the partial sums' float32 traffic (written
    and read back) under an eighth of the weights' bytes; 1 where that cap allows no split."""
    slabs = -(-k_dim // block_k)
    most = max(1, k_dim * itemsize // (64 * rows))  # 2 * splits * rows * 4 bytes <= K * itemsize / 8 per column
    divisors = [s for s in range(1, slabs + 1) if slabs % s == 0 and s <= most]
    enough = [s for s in divisors if s * column_blocks >= per_sm * device_sm_count()]
    return enough[0] if enough else divisors[-1]


def pipeline_stages(num_stages: int, block_m: int, block_k: int, block_n: int, itemsize: int, *, glu: bool,
                    has_gate: bool) -> int:
    """num_stages, fewer where its buffers of one K slab (x, the gate's columns, the weight blocks) would
    pass SHARED_BYTES; at least 1."""
    slab = block_k * (block_m * (1 + has_gate) + block_n * (1 + glu)) * itemsize
    return max(1, min(num_stages, SHARED_BYTES // slab))


def fma_block_k(block_m: int, block_n: int, num_warps: int, glu: bool) -> int:
    """The fma body's K slab: the most rows (a power of two, 1 to BLOCK_K) for which the products of
    block_m rows x block_n columns (twice with glu) stay within FMA_ACC_PER_THREAD a thread."""
    room = FMA_ACC_PER_THREAD * 32 * num_warps // (block_m * block_n * (1 + glu))
    return max(1, min(BLOCK_K, 1 << max(0, room.bit_length() - 1)))


def gated_fits(group: int) -> bool:
    """Whether the kernel takes a gated norm over groups of `group` channels (one slab per group)."""
    return is_pow2(group) and group >= MIN_DOT


def _finish(accs, squares, r_ref, o_ref, *, row, cols, row_ok, col_ok, scaled: bool, glu: bool,
            has_residual: bool, eps: float, k_dim: int):
    """The epilogue of a block of float32 sums: the RMSNorm's row scale (`scaled`), each projection
    rounded as the reference's matmul, the SwiGLU, the residual add; stored to o_ref."""
    if scaled:
        scale = jax.lax.rsqrt(squares / k_dim + eps)[:, None]
        accs = tuple(acc * scale for acc in accs)
    out = [acc.astype(o_ref.dtype) for acc in accs]
    y = (jax.nn.silu(out[0].astype(jnp.float32)) * out[1].astype(jnp.float32)).astype(o_ref.dtype) if glu else out[0]
    mask = row_ok[:, None] & col_ok[None, :]
    if has_residual:
        res = pltriton.load(r_ref.at[row[:, None], cols[None, :]], mask=mask, other=0.0)
        y = (res.astype(jnp.float32) + y.astype(jnp.float32)).astype(o_ref.dtype)
    pltriton.store(o_ref.at[row[:, None], cols[None, :]], y, mask=mask)


def _fused_kernel(
    x_ref,  # [M, K]
    w_ref,  # [K, N]  (glu: [gate | up], N = 2 * n_out); weight_nk: [N, K]
    *refs,  # norm [K] (gated: [block_k]), gate [M, *], residual [M, n_out] (each when given; with split-K
    #         and merge "kernel" the residual goes to the second kernel), then the outputs: out [M, n_out];
    #         or, split (splits > 1), partial sums [splits * M, N] (and squares [column blocks * splits * M]),
    #         merge "fused" preceded by the counters' input and followed by out and the counters
    has_norm: bool,
    has_gate: bool,
    gate_at: int,
    gate_group: int,
    gate_pitch: int,
    zero_centered: bool,
    glu: bool,
    has_residual: bool,
    weight_nk: bool,
    eps: float,
    rows: int,
    k_dim: int,
    n_out: int,
    block_m: int,
    block_k: int,
    block_n: int,
    slabs_per_split: int,
    splits: int,
    body: str,
    merge: str,
    barrier: bool,
):
    refs = list(refs)
    g_ref = refs.pop(0) if has_norm else None
    z_ref = refs.pop(0) if has_gate else None
    r_ref = refs.pop(0) if has_residual else None
    scaled = has_norm and not has_gate  # the RMSNorm's row scale, applied after the dot
    row = jnp.arange(block_m, dtype=jnp.int32)
    row_ok = row < rows
    slab = jnp.arange(block_k, dtype=jnp.int32)
    cols = pl.program_id(0) * block_n + jnp.arange(block_n, dtype=jnp.int32)
    col_ok = cols < n_out
    split = splits > 1
    first_slab = pl.program_id(1) * slabs_per_split
    k_tail, n_tail = k_dim % block_k != 0, n_out % block_n != 0
    offsets = (0, n_out) if glu else (0,)  # the up projection's columns follow the gate's

    def k_step(t, carry):
        accs, squares = carry
        ks = (first_slab + t) * block_k + slab
        k_ok = ks < k_dim
        x_mask = row_ok[:, None] & k_ok[None, :]
        xb = pltriton.load(x_ref.at[row[:, None], ks[None, :]], mask=x_mask, other=0.0)
        if has_gate:
            z_cols = gate_at + ks // gate_group * gate_pitch + ks % gate_group
            z = pltriton.load(z_ref.at[row[:, None], z_cols[None, :]], mask=x_mask, other=0.0).astype(jnp.float32)
        if has_gate and has_norm:  # one group per slab: rms_norm_gated's roundings
            xf = xb.astype(jnp.float32)
            y = (xf * jax.lax.rsqrt(jnp.sum(xf * xf, axis=1, keepdims=True) / block_k + eps)).astype(g_ref.dtype)
            y = pltriton.load(g_ref.at[slab])[None, :] * y
            xb = (y.astype(jnp.float32) * jax.nn.silu(z)).astype(x_ref.dtype)
        elif has_gate:  # the reference's roundings: sigmoid(z), then the product, each in x.dtype
            sig = jax.nn.sigmoid(z).astype(x_ref.dtype).astype(jnp.float32)
            xb = (xb.astype(jnp.float32) * sig).astype(x_ref.dtype)
        elif has_norm:
            xf = xb.astype(jnp.float32)
            squares = squares + jnp.sum(xf * xf, axis=1)
            g = pltriton.load(g_ref.at[ks], mask=k_ok, other=0.0).astype(jnp.float32)
            xb = (xf * (1.0 + g if zero_centered else g)[None, :]).astype(x_ref.dtype)
        new = []
        for acc, at in zip(accs, offsets, strict=True):
            if weight_nk:  # a block of whole rows of K: block_n runs of block_k contiguous weights
                w_at, w_mask = w_ref.at[at + cols[:, None], ks[None, :]], col_ok[:, None] & k_ok[None, :]
            else:
                w_at, w_mask = w_ref.at[ks[:, None], at + cols[None, :]], k_ok[:, None] & col_ok[None, :]
            wb = pltriton.load(w_at, mask=w_mask, other=0.0) if k_tail or n_tail else w_at[...]
            if body == "dot":
                new.append(acc + dot(xb, wb, contract_b=1 if weight_nk else 0))
            else:  # products [block_m, block_k, block_n] ([.., block_n, block_k] for nk), K summed after the walk
                xf, wf = xb.astype(jnp.float32), wb.astype(jnp.float32)[None]
                new.append(acc + (xf[:, None, :] if weight_nk else xf[:, :, None]) * wf)
        return tuple(new), squares

    acc_shape = (block_m, block_n)
    if body == "fma":
        acc_shape = (block_m, block_n, block_k) if weight_nk else (block_m, block_k, block_n)
    zeros = tuple(jnp.zeros(acc_shape, jnp.float32) for _ in offsets)
    accs, squares = jax.lax.fori_loop(0, slabs_per_split, k_step, (zeros, jnp.zeros((block_m,), jnp.float32)))
    if body == "fma":
        accs = tuple(jnp.sum(acc, axis=2 if weight_nk else 1) for acc in accs)
    if not split:
        (o_ref,) = refs
        _finish(accs, squares, r_ref, o_ref, row=row, cols=cols, row_ok=row_ok, col_ok=col_ok, scaled=scaled,
                glu=glu, has_residual=has_residual, eps=eps, k_dim=k_dim)
        return
    if merge == "fused":
        refs.pop(0)  # the counters' input, aliased to the counters output (zeros at the launch), not read
    part_ref = refs.pop(0)
    sq_ref = refs.pop(0) if scaled else None
    j, s = pl.program_id(0), pl.program_id(1)
    at_rows = s * rows + row  # this split's rows of the partial sums
    for acc, at in zip(accs, offsets, strict=True):
        pltriton.store(part_ref.at[at_rows[:, None], at + cols[None, :]], acc, mask=row_ok[:, None] & col_ok[None, :])
    if scaled:  # every program stores its run's squares, at its column block's rows
        pltriton.store(sq_ref.at[j * splits * rows + at_rows], squares, mask=row_ok)
    if merge == "kernel":
        return
    o_ref, count_ref = refs

    @pl.when(arrived_last(count_ref, j, splits, barrier))  # as the attention kernel's fused merge
    def _merge():
        _merge_splits(j, part_ref, sq_ref, r_ref, o_ref, splits=splits, scaled=scaled, glu=glu,
                      has_residual=has_residual, eps=eps, rows=rows, k_dim=k_dim, n_out=n_out, block_m=block_m,
                      block_n=block_n)


def _merge_splits(j, part_ref, sq_ref, r_ref, o_ref, *, splits: int, scaled: bool, glu: bool, has_residual: bool,
                  eps: float, rows: int, k_dim: int, n_out: int, block_m: int, block_n: int):
    """Sum the splits' partial sums (and squares) of column block j, then the one-pass epilogue."""
    row = jnp.arange(block_m, dtype=jnp.int32)
    row_ok = row < rows
    cols = j * block_n + jnp.arange(block_n, dtype=jnp.int32)
    col_ok = cols < n_out
    mask = row_ok[:, None] & col_ok[None, :]
    accs = [jnp.zeros((block_m, block_n), jnp.float32) for _ in range(1 + glu)]
    squares = jnp.zeros((block_m,), jnp.float32)
    for s in range(splits):
        at_rows = s * rows + row
        for i in range(len(accs)):
            accs[i] = accs[i] + pltriton.load(part_ref.at[at_rows[:, None], i * n_out + cols[None, :]], mask=mask,
                                              other=0.0)
        if scaled:
            squares = squares + pltriton.load(sq_ref.at[j * splits * rows + at_rows], mask=row_ok, other=0.0)
    _finish(tuple(accs), squares, r_ref, o_ref, row=row, cols=cols, row_ok=row_ok, col_ok=col_ok, scaled=scaled,
            glu=glu, has_residual=has_residual, eps=eps, k_dim=k_dim)


def _combine_kernel(part_ref, *refs, scaled: bool, has_residual: bool, **kw):
    """Split-K's second pass (merge "kernel"): one program per column block, `_merge_splits`."""
    refs = list(refs)
    sq_ref = refs.pop(0) if scaled else None
    r_ref = refs.pop(0) if has_residual else None
    (o_ref,) = refs
    _merge_splits(pl.program_id(0), part_ref, sq_ref, r_ref, o_ref, scaled=scaled, has_residual=has_residual, **kw)


def fused_linear_pallas(
    x: jax.Array,  # [M, K], M <= MAX_ROWS
    w: jax.Array,  # [K, N]
    norm: jax.Array | None = None,  # [K]
    residual: jax.Array | None = None,  # [M, n_out]
    *,
    gate: jax.Array | None = None,  # [M, *], its K columns from gate_at; norm: the gated norm's weight [G]
    gate_at: int = 0,
    gate_layout: tuple[int, int] | None = None,  # (group, pitch) of the gate columns; None: contiguous
    eps: float = 1e-6,
    zero_centered: bool = False,
    glu: bool = False,
    interpret: bool = False,
    num_warps: int = 4,
    num_stages: int = 4,
    blocks: tuple[int, int] | None = None,
    weight_nk: bool = False,
    splits: int | None = None,
    body: str = "dot",
    merge: str = "kernel",
) -> jax.Array:
    """reference.fused_linear in one kernel (two with split-K). blocks: (block_k, block_n), powers of two >= 16; None
    picks `block_sizes` (with a gated norm, block_k is the norm's group, a power of two >= 16).
    weight_nk: w is stored transposed, [N, K] (HF's layout; glu: gate rows, then up rows), so a
    program reads contiguous runs of K rather than of N (benchmarks/kernel_sweep.py times both).
    splits: programs per column block, each walking an equal run of the K slabs (split-K; it must
    divide the slab count), their partial sums added by a second kernel that runs the epilogue;
    None: `split_count`'s (for the blocks used); 1: one pass, the epilogue in the same kernel.
    body: "dot" (tensor cores, rows padded to >= 16) or "fma" (per-thread products, K summed once;
    rows padded to a power of two; block_k defaults to `fma_block_k`, splits aim at
    FMA_PROGRAMS_PER_SM programs an SM), see the module docstring.
    merge: where split-K's partial sums meet: "kernel", a second launch; "fused", the last program of
    each column block to finish (an atomic counter tells), in the same launch.
    Arguments are checked by api.py, which passes [K, N]."""
    rows, k_dim = x.shape
    if rows > MAX_ROWS:
        raise ValueError(f"fused_linear_pallas takes at most {MAX_ROWS} rows; got x {x.shape}")
    if w.shape[1 if weight_nk else 0] != k_dim:
        raise ValueError(f"w must be {'[N, K]' if weight_nk else '[K, N]'} with K = {k_dim}; got w {w.shape}")
    if body not in BODIES:
        raise ValueError(f"body must be one of {BODIES}; got {body!r}")
    if merge not in MERGES:
        raise ValueError(f"merge must be one of {MERGES}; got {merge!r}")
    n_out = output_columns(w.shape[0 if weight_nk else 1], glu)
    block_m, block_k, block_n, _ = block_sizes(rows, k_dim, n_out, x.dtype.itemsize, glu)
    if body == "fma":
        block_m = pow2_at_least(rows, 1)
        block_k = min(block_k, fma_block_k(block_m, block_n, num_warps, glu))
    if blocks is not None:
        block_k, block_n = blocks
    if gate is not None and norm is not None:
        block_k = norm.shape[0]
        if not gated_fits(block_k):
            raise ValueError(f"a gated norm's group must be a power of two >= {MIN_DOT}; got {block_k}")
    if splits is None:
        per_sm = FMA_PROGRAMS_PER_SM if body == "fma" else PROGRAMS_PER_SM
        splits = split_count(rows, k_dim, block_k, pl.cdiv(n_out, block_n), x.dtype.itemsize, per_sm)
    slabs = pl.cdiv(k_dim, block_k)
    if splits < 1 or slabs % splits:
        raise ValueError(f"splits must be a divisor of the {slabs} K slabs ({k_dim} / {block_k}); got {splits}")
    split = splits > 1
    fused = split and merge == "fused"
    scaled = norm is not None and gate is None
    columns = pl.cdiv(n_out, block_n)
    own_residual = residual if fused or not split else None  # else the second kernel adds it
    gate_group, gate_pitch = gate_layout or (k_dim, k_dim)
    kernel = functools.partial(_fused_kernel, has_norm=norm is not None, has_gate=gate is not None, gate_at=gate_at,
                               gate_group=gate_group, gate_pitch=gate_pitch, zero_centered=zero_centered, glu=glu,
                               has_residual=own_residual is not None, weight_nk=weight_nk,
                               eps=eps, rows=rows, k_dim=k_dim, n_out=n_out, block_m=block_m, block_k=block_k,
                               block_n=block_n, slabs_per_split=slabs // splits, splits=splits, body=body,
                               merge=merge, barrier=not interpret)
    operands = [a for a in (x, w, norm, gate, own_residual) if a is not None]
    whole = lambda shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))  # noqa: E731
    out = jax.ShapeDtypeStruct((rows, n_out), x.dtype)
    out_shape, aliases = [out], {}
    if split:
        out_shape = [jax.ShapeDtypeStruct((splits * rows, n_out * (1 + glu)), jnp.float32)]
        out_shape += [jax.ShapeDtypeStruct((columns * splits * rows,), jnp.float32)] if scaled else []
    if fused:  # the counters (zeros at the launch), updated in place
        counters = jax.ShapeDtypeStruct((columns,), jnp.int32)
        operands.append(jnp.zeros(counters.shape, counters.dtype))
        out_shape += [out, counters]
        aliases = {len(operands) - 1: len(out_shape) - 1}
    stages = pipeline_stages(min(num_stages, slabs // splits), block_m, block_k, block_n, x.dtype.itemsize,
                             glu=glu, has_gate=gate is not None)
    call = pl.pallas_call(
        kernel,
        grid=(columns, splits),
        in_specs=[whole(a.shape) for a in operands],
        out_specs=[whole(o.shape) for o in out_shape],
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=triton_compiler_params(num_warps, stages),
        interpret=interpret,
        name="fused_linear",
    )
    with ignore_triton_deprecation():
        outs = call(*operands)
    if not split:
        return outs[0]
    if fused:
        return outs[-2]
    combine = functools.partial(_combine_kernel, splits=splits, scaled=scaled, glu=glu,
                                has_residual=residual is not None, eps=eps, rows=rows, k_dim=k_dim, n_out=n_out,
                                block_m=block_m, block_n=block_n)
    operands = [*outs, *([] if residual is None else [residual])]
    call = pl.pallas_call(
        combine,
        grid=(columns,),
        in_specs=[whole(a.shape) for a in operands],
        out_specs=whole((rows, n_out)),
        out_shape=out,
        compiler_params=triton_compiler_params(num_warps, 1),
        interpret=interpret,
        name="fused_linear_combine",
    )
    with ignore_triton_deprecation():
        return call(*operands)
