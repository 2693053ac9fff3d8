"""GDN verify/decode recurrence: Pallas kernel (Triton lowering) with one state snapshot per token.

Same semantics as `reference.gdn_verify`. One program per (request, value head, V-block): it holds
the `[dk, BV]` float32 tile of the start state in registers and runs the T = 1+k tokens
(decode is T = 1), per token (docs/model_math.md#recurrence, state h = S^T):

    h <- exp(g_t) h ;  h <- h + k_t (beta_t (v_t - h^T k_t))^T ;  o_t = h^T q_t

then stores o_t and the snapshot h -> pool[write_idx[b, t]]. The start tile is loaded from
pool[read_idx[b]] before any store (the read slot is one of the write slots), and the pool is
updated in place through `input_output_aliases` (the engine donates it). Every product here is a
matrix-vector one, so the kernel uses broadcasts and float32 reductions, no tensor-core dots:
it is bandwidth bound on the state (1 read + T writes of `[dk, dv]` per head).

Value head j reads key head j // (HV // HK) (GVA). Tokens t >= num_valid[b] are inert: their
q/k/v/g/beta are zeroed (as the reference does), so the state is unchanged and o_t = 0.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.triton_common import ignore_triton_deprecation, is_pow2, triton_compiler_params

F32 = jnp.float32


def _verify_kernel(
    q_ref,  # [T, dk]        queries of this request, key head h // r (normalised, scaled)
    k_ref,  # [T, dk]        keys, same key head (normalised)
    v_ref,  # [T, BV]        values, this value head and V-block
    g_ref,  # [T]            log decay of this value head (<= 0)
    beta_ref,  # [T]         write strength
    pool_ref,  # [S, dk, BV] state pool as read (this head, this V-block)
    read_ref,  # [1] int32   slot of the start state
    write_ref,  # [T] int32  slot receiving the state after token t
    has_ref,  # [1] int32    0 -> start from zeros
    valid_ref,  # [1] int32  num_valid: tokens t >= num_valid are inert
    o_ref,  # [T, BV] f32    readout per token
    pool_out_ref,  # [S, dk, BV] the same pool buffer (aliased), receives the snapshots
    *,
    barrier: bool,
):
    n_valid = valid_ref[0]
    h = pool_ref[read_ref[0]].astype(F32)  # [dk, BV]
    h = jnp.where(has_ref[0] != 0, h, 0.0)
    if barrier:  # every thread holds its part of the start tile before any snapshot is stored
        pltriton.debug_barrier()

    # The T steps are unrolled (T = 1 + k is static): no load of a token depends on the
    # state, so the compiler issues every token's q / k / v / g / beta and write slot ahead of the
    # chain of state updates instead of paying a global-load latency per step.
    for t in range(q_ref.shape[0]):
        live = t < n_valid

        def load(ref):  # token t of ref in float32, zero for an inert token
            return jnp.where(live, ref[t].astype(F32), 0.0)

        q, k, v, g, beta = (load(r) for r in (q_ref, k_ref, v_ref, g_ref, beta_ref))
        h = h * jnp.exp(g)
        pred = jnp.sum(h * k[:, None], axis=0)  # [BV] = h^T k
        h = h + k[:, None] * (beta * (v - pred))[None, :]
        o_ref[t] = jnp.sum(h * q[:, None], axis=0).astype(o_ref.dtype)  # h^T q, after the update
        pool_out_ref[write_ref[t]] = h.astype(pool_out_ref.dtype)


# V-block width: 32 columns; 64 once the grid has this many programs at 64 columns. Busy time per
# call on one H200 (docs/benchmarks.md, "GDN verify blocks"): 64 columns cut 7-10% at batch 32 and
# at Qwen3.5-27B batch 8, and cost 20-70% where the grid is small (Qwen3.5-2B batch 8, batch 1).
WIDE_BLOCK_V, WIDE_MIN_PROGRAMS = 64, 512


def default_block_v(b: int, hv: int, dv: int) -> int:
    if dv % WIDE_BLOCK_V == 0 and b * hv * (dv // WIDE_BLOCK_V) >= WIDE_MIN_PROGRAMS:
        return WIDE_BLOCK_V
    return min(32, dv)


def _check(q, v, pool, block_v: int):
    hk, dk = q.shape[2:]
    hv, dv = v.shape[2:]
    if hv % hk:
        raise ValueError(f"value heads {hv=} must be a multiple of key heads {hk=}")
    if pool.shape[1:] != (hv, dk, dv):
        raise ValueError(f"pool shape {pool.shape} must be [S, {hv}, {dk}, {dv}]")
    if not (is_pow2(dk) and is_pow2(block_v) and dv % block_v == 0):
        raise ValueError(f"{dk=} and {block_v=} must be powers of two, block_v dividing {dv=} (Triton tiles)")


def gdn_verify_pallas(
    q: jax.Array,  # [B, T, HK, dk] L2-normalised, scaled by dk**-0.5
    k: jax.Array,  # [B, T, HK, dk] L2-normalised
    v: jax.Array,  # [B, T, HV, dv]
    g: jax.Array,  # [B, T, HV] log decay
    beta: jax.Array,  # [B, T, HV]
    pool: jax.Array,  # [S, HV, dk, dv] float32 state pool (slot 0 = null slot)
    read_idx: jax.Array,  # [B] int32
    write_idx: jax.Array,  # [B, T] int32
    has_state: jax.Array,  # [B] bool
    num_valid: jax.Array,  # [B] int32
    *,
    interpret: bool = False,
    block_v: int | None = None,
    num_warps: int = 4,
) -> tuple[jax.Array, jax.Array]:
    """Pallas GDN verify/decode; same contract as `reference.gdn_verify`.

    Returns o [B, T, HV, dv] float32 and the pool with pool[write_idx[b, t]] = state after token t.
    `block_v` (static, power of two dividing dv; None: `default_block_v`) is the V-block width of
    one program. With duplicate write slots (padding rows all write the null slot 0) the last writer
    wins, so slot 0 holds any one of them. `interpret=True` is required on CPU.
    """
    b, t, hk, dk = q.shape
    hv, dv = v.shape[2:]
    block_v = block_v or default_block_v(b, hv, dv)
    _check(q, v, pool, block_v)
    r = hv // hk
    n_slots = pool.shape[0]
    key_spec = pl.BlockSpec((None, t, None, dk), lambda i, h, j: (i, 0, h // r, 0))
    value_spec = pl.BlockSpec((None, t, None, block_v), lambda i, h, j: (i, 0, h, j))
    gate_spec = pl.BlockSpec((None, t, None), lambda i, h, j: (i, 0, h))
    pool_spec = pl.BlockSpec((n_slots, None, dk, block_v), lambda i, h, j: (0, h, 0, j))
    scalar_spec = pl.BlockSpec((1,), lambda i, h, j: (i,))
    call = pl.pallas_call(
        functools.partial(_verify_kernel, barrier=not interpret),
        grid=(b, hv, dv // block_v),
        in_specs=[
            key_spec,  # q
            key_spec,  # k
            value_spec,  # v
            gate_spec,  # g
            gate_spec,  # beta
            pool_spec,  # pool
            scalar_spec,  # read_idx
            pl.BlockSpec((None, t), lambda i, h, j: (i, 0)),  # write_idx
            scalar_spec,  # has_state
            scalar_spec,  # num_valid
        ],
        out_specs=[value_spec, pool_spec],
        out_shape=[jax.ShapeDtypeStruct(v.shape, F32), jax.ShapeDtypeStruct(pool.shape, pool.dtype)],
        input_output_aliases={5: 1},
        compiler_params=triton_compiler_params(num_warps, num_stages=1),
        interpret=interpret,
        name="gdn_verify",
    )
    i32 = jnp.int32
    with ignore_triton_deprecation():
        return call(
            q, k, v, g, beta, pool,
            read_idx.astype(i32), write_idx.astype(i32), has_state.astype(i32), num_valid.astype(i32),
        )
