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
MAX_BLOCK_N = 64
# Bytes of weights one pipeline stage of a program loads: enough in flight per SM to stream at the
# bandwidth when there is about one program per SM.
STAGE_BYTES = 16384
# Shared memory the pipeline's buffers may take (an H200 SM has 227 KiB): with many rows the x slab
# (and the gate's) outweighs the weights', so `pipeline_stages` trims the stages to fit.
SHARED_BYTES = 200 * 1024


def block_sizes(rows: int, k_dim: int, n_out: int, itemsize: int, glu: bool = False) -> tuple[int, int, int]:
    """(block_m, block_k, block_n): block_m covers the rows (>= 16); block_n is the widest power of
    two up to 64 that still gives one program per SM (down to 16); block_k makes a stage's weight
    slabs about STAGE_BYTES (at most K rounded up to a power of two)."""
    block_m = pow2_at_least(rows)
    block_n = min(MAX_BLOCK_N, pow2_at_least(n_out))
    while block_n > MIN_DOT and -(-n_out // block_n) < device_sm_count():
        block_n //= 2
    block_k = STAGE_BYTES // (itemsize * block_n * (1 + glu))
    return block_m, max(MIN_DOT, min(block_k, pow2_at_least(k_dim))), block_n


def pipeline_stages(num_stages: int, block_m: int, block_k: int, block_n: int, itemsize: int, *, glu: bool,
                    has_gate: bool) -> int:
    """num_stages, fewer where its buffers of one K slab (x, the gate's columns, the weight blocks) would
    pass SHARED_BYTES; at least 1."""
    slab = block_k * (block_m * (1 + has_gate) + block_n * (1 + glu)) * itemsize
    return max(1, min(num_stages, SHARED_BYTES // slab))


def gated_fits(group: int) -> bool:
    """Whether the kernel takes a gated norm over groups of `group` channels (one slab per group)."""
    return is_pow2(group) and group >= MIN_DOT


def _fused_kernel(
    x_ref,  # [M, K]
    w_ref,  # [K, N]  (glu: [gate | up], N = 2 * n_out); weight_nk: [N, K]
    *refs,  # norm [K] (gated: [block_k]), gate [M, *], residual [M, n_out] (each when given), out [M, n_out]
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
):
    refs = list(refs)
    g_ref = refs.pop(0) if has_norm else None
    z_ref = refs.pop(0) if has_gate else None
    r_ref = refs.pop(0) if has_residual else None
    (o_ref,) = refs
    row = jnp.arange(block_m, dtype=jnp.int32)
    row_ok = row < rows
    slab = jnp.arange(block_k, dtype=jnp.int32)
    cols = pl.program_id(0) * block_n + jnp.arange(block_n, dtype=jnp.int32)
    col_ok = cols < n_out
    k_tail, n_tail = k_dim % block_k != 0, n_out % block_n != 0
    offsets = (0, n_out) if glu else (0,)  # the up projection's columns follow the gate's

    def k_step(t, carry):
        accs, squares = carry
        ks = t * block_k + slab
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
            new.append(acc + dot(xb, wb, contract_b=1 if weight_nk else 0))
        return tuple(new), squares

    zeros = tuple(jnp.zeros((block_m, block_n), jnp.float32) for _ in offsets)
    accs, squares = jax.lax.fori_loop(0, pl.cdiv(k_dim, block_k), k_step,
                                      (zeros, jnp.zeros((block_m,), jnp.float32)))
    if has_norm and not has_gate:
        scale = jax.lax.rsqrt(squares / k_dim + eps)[:, None]
        accs = tuple(acc * scale for acc in accs)
    out = [acc.astype(o_ref.dtype) for acc in accs]  # each projection rounded, as the reference's matmul
    y = (jax.nn.silu(out[0].astype(jnp.float32)) * out[1].astype(jnp.float32)).astype(o_ref.dtype) if glu else out[0]
    mask = row_ok[:, None] & col_ok[None, :]
    if has_residual:
        res = pltriton.load(r_ref.at[row[:, None], cols[None, :]], mask=mask, other=0.0)
        y = (res.astype(jnp.float32) + y.astype(jnp.float32)).astype(o_ref.dtype)
    pltriton.store(o_ref.at[row[:, None], cols[None, :]], y, mask=mask)


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
) -> jax.Array:
    """reference.fused_linear in one kernel. blocks: (block_k, block_n), powers of two >= 16; None
    picks `block_sizes` (with a gated norm, block_k is the norm's group, a power of two >= 16).
    weight_nk: w is stored transposed, [N, K] (HF's layout; glu: gate rows, then up rows), so a
    program reads contiguous runs of K rather than of N (benchmarks/kernel_sweep.py times both).
    Arguments are checked by api.py, which passes [K, N]."""
    rows, k_dim = x.shape
    if rows > MAX_ROWS:
        raise ValueError(f"fused_linear_pallas takes at most {MAX_ROWS} rows; got x {x.shape}")
    if w.shape[1 if weight_nk else 0] != k_dim:
        raise ValueError(f"w must be {'[N, K]' if weight_nk else '[K, N]'} with K = {k_dim}; got w {w.shape}")
    n_out = output_columns(w.shape[0 if weight_nk else 1], glu)
    block_m, block_k, block_n = block_sizes(rows, k_dim, n_out, x.dtype.itemsize, glu)
    if blocks is not None:
        block_k, block_n = blocks
    if gate is not None and norm is not None:
        block_k = norm.shape[0]
        if not gated_fits(block_k):
            raise ValueError(f"a gated norm's group must be a power of two >= {MIN_DOT}; got {block_k}")
    gate_group, gate_pitch = gate_layout or (k_dim, k_dim)
    kernel = functools.partial(_fused_kernel, has_norm=norm is not None, has_gate=gate is not None, gate_at=gate_at,
                               gate_group=gate_group, gate_pitch=gate_pitch, zero_centered=zero_centered, glu=glu,
                               has_residual=residual is not None, weight_nk=weight_nk, eps=eps, rows=rows,
                               k_dim=k_dim, n_out=n_out, block_m=block_m, block_k=block_k, block_n=block_n)
    operands = [a for a in (x, w, norm, gate, residual) if a is not None]
    whole = lambda shape: pl.BlockSpec(shape, lambda j: (0,) * len(shape))  # noqa: E731
    call = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(n_out, block_n),),
        in_specs=[whole(a.shape) for a in operands],
        out_specs=whole((rows, n_out)),
        out_shape=jax.ShapeDtypeStruct((rows, n_out), x.dtype),
        compiler_params=triton_compiler_params(num_warps, pipeline_stages(
            num_stages, block_m, block_k, block_n, x.dtype.itemsize, glu=glu, has_gate=gate is not None)),
        interpret=interpret,
        name="fused_linear",
    )
    with ignore_triton_deprecation():
        return call(*operands)
