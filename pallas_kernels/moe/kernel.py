"""Grouped expert matmuls: Pallas kernel (Triton lowering) with the contract of `reference.py`.

One program per (group slot, block of output columns). The wrapper lists the groups that own rows
(at most min(E, P) of them, in group order) as slots: slot s holds group `expert[s]`, whose rows are
`start[s] .. start[s] + count[s]` of x. Slots past the non-empty groups have count 0 and return at
once, so the grid never visits the E - (non-empty) empty experts of a decode step's routing, and
each chosen expert's weight columns are read once per block of `block_m` of its rows: at decode (one
row per pair) that is the union of the chosen experts' weights, the step's bytes floor, where XLA's
gather path copies every chosen expert's weights out first and its grouped path (ragged_dot) visits
all E experts.

A program walks its group's rows in blocks of `block_m` (rows of other groups and past P are
masked) and, for each, accumulates `x[rows] @ w[expert][:, cols]` in float32 over `block_k`-row
slabs of the weights. `grouped_glu` loads the gate and up slabs together and stores
silu(x w_gate) * (x w_up), rounded once to x.dtype.

Weights are read through a free reshape to `[E * K, N]` (expert e's rows start at e * K), like the
attention kernel's page pools. K and N need not be powers of two (the last slab / column block is
masked); Triton's power-of-two tensor sizes are the blocks'.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.triton_common import MIN_DOT, dot, ignore_triton_deprecation, pow2_at_least, triton_compiler_params

# Aim for at least this many programs (about two per SM of an H100 / H200) when choosing the
# column block, so a decode step's few experts still spread over the GPU.
TARGET_PROGRAMS = 256
MAX_BLOCK_N = 128
MAX_BLOCK_M = 64
BLOCK_K = 64


def block_sizes(rows: int, slots: int, k_dim: int, n_dim: int) -> tuple[int, int, int]:
    """(block_m, block_k, block_n) for `rows` sorted rows over `slots` non-empty-group slots.

    block_m: the average rows per slot, as a power of two in [16, 64]. block_n: the widest power of
    two up to 128 that still gives every slot's columns TARGET_PROGRAMS programs in all (down to
    16). block_k: 64, or K rounded up to a power of two when smaller."""
    block_m = min(MAX_BLOCK_M, pow2_at_least(-(-rows // max(slots, 1))))
    block_n = min(MAX_BLOCK_N, pow2_at_least(n_dim))
    while block_n > MIN_DOT and slots * -(-n_dim // block_n) < TARGET_PROGRAMS:
        block_n //= 2
    return block_m, min(BLOCK_K, pow2_at_least(k_dim)), block_n


def group_slots(group_sizes: jax.Array, n_slots: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(expert, start, count) [n_slots] int32: the non-empty groups in order, each with its first
    row and row count; the slots past them hold group 0 with count 0."""
    sizes = group_sizes.astype(jnp.int32)
    starts = jnp.cumsum(sizes) - sizes
    (expert,) = jnp.nonzero(sizes > 0, size=n_slots, fill_value=0)
    expert = expert.astype(jnp.int32)
    live = jnp.arange(n_slots) < jnp.count_nonzero(sizes)
    return expert, starts[expert], jnp.where(live, sizes[expert], 0)


def _grouped_kernel(
    x_ref,  # [P, K]       rows sorted by group
    *refs,  # w [E * K, N] (glu: w_gate, w_up), expert [1], start [1], count [1], out [P, N]
    glu: bool,
    k_dim: int,
    n_dim: int,
    block_m: int,
    block_k: int,
    block_n: int,
):
    w_refs, (expert_ref, start_ref, count_ref, o_ref) = refs[: 1 + glu], refs[1 + glu :]
    expert, start, count = expert_ref[0], start_ref[0], count_ref[0]
    n_rows = x_ref.shape[0]
    row = jnp.arange(block_m, dtype=jnp.int32)
    slab = jnp.arange(block_k, dtype=jnp.int32)
    cols = pl.program_id(1) * block_n + jnp.arange(block_n, dtype=jnp.int32)
    col_ok = cols < n_dim
    k_tail, n_tail = k_dim % block_k != 0, n_dim % block_n != 0

    def row_block(b, carry):
        local = b * block_m + row
        row_ok = local < count
        rows = jnp.where(row_ok, start + local, n_rows)  # masked rows point one past the end

        def k_step(t, accs):
            ks = t * block_k + slab
            k_ok = ks < k_dim
            xb = pltriton.load(x_ref.at[rows[:, None], ks[None, :]], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w_rows = expert * k_dim + ks
            w_mask = k_ok[:, None] & col_ok[None, :]
            new = []
            for acc, w_ref in zip(accs, w_refs, strict=True):
                at = w_ref.at[w_rows[:, None], cols[None, :]]
                wb = pltriton.load(at, mask=w_mask, other=0.0) if (k_tail or n_tail) else at[...]
                new.append(acc + dot(xb, wb, contract_b=0))
            return tuple(new)

        zeros = tuple(jnp.zeros((block_m, block_n), jnp.float32) for _ in w_refs)
        accs = jax.lax.fori_loop(0, pl.cdiv(k_dim, block_k), k_step, zeros)
        out = jax.nn.silu(accs[0]) * accs[1] if glu else accs[0]
        pltriton.store(o_ref.at[rows[:, None], cols[None, :]], out.astype(o_ref.dtype),
                       mask=row_ok[:, None] & col_ok[None, :])
        return carry

    jax.lax.fori_loop(0, pl.cdiv(count, block_m), row_block, 0)


def grouped_matmul_pallas(
    x: jax.Array,  # [P, K] rows sorted by group
    weights: tuple[jax.Array, ...],  # one [E, K, N] (matmul) or two (glu: gate, up)
    group_sizes: jax.Array,  # [E] int32, summing to P
    *,
    interpret: bool = False,
    num_warps: int = 4,
    num_stages: int = 3,
    blocks: tuple[int, int, int] | None = None,
) -> jax.Array:
    """x times its group's weights -> [P, N] in x.dtype; with two weights, silu(x w0) * (x w1).
    blocks: (block_m, block_k, block_n), powers of two >= 16; None picks `block_sizes`."""
    p_rows, k_dim = x.shape
    n_groups, _, n_dim = weights[0].shape
    for w in weights:
        if w.shape != (n_groups, k_dim, n_dim):
            raise ValueError(f"weights must all be [E, K, N] = {(n_groups, k_dim, n_dim)} for x {x.shape}; "
                             f"got {w.shape}")
    if any(w.dtype != x.dtype for w in weights):
        raise ValueError(f"weights must have x's dtype {x.dtype}; got {[str(w.dtype) for w in weights]}")
    if group_sizes.shape != (n_groups,):
        raise ValueError(f"group_sizes must be [E] = [{n_groups}], got {group_sizes.shape}")
    n_slots = min(n_groups, p_rows)
    block_m, block_k, block_n = blocks or block_sizes(p_rows, n_slots, k_dim, n_dim)
    expert, start, count = group_slots(group_sizes, n_slots)
    kernel = functools.partial(_grouped_kernel, glu=len(weights) == 2, k_dim=k_dim, n_dim=n_dim,
                               block_m=block_m, block_k=block_k, block_n=block_n)
    flat = (n_groups * k_dim, n_dim)
    whole = lambda shape: pl.BlockSpec(shape, lambda s, j: (0, 0))  # noqa: E731
    slot = pl.BlockSpec((1,), lambda s, j: (s,))
    call = pl.pallas_call(
        kernel,
        grid=(n_slots, pl.cdiv(n_dim, block_n)),
        in_specs=[whole(x.shape), *(whole(flat) for _ in weights), slot, slot, slot],
        out_specs=whole((p_rows, n_dim)),
        out_shape=jax.ShapeDtypeStruct((p_rows, n_dim), x.dtype),
        compiler_params=triton_compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="grouped_glu" if len(weights) == 2 else "grouped_matmul",
    )
    with ignore_triton_deprecation():
        return call(x, *(w.reshape(flat) for w in weights), expert, start, count)
