"""GDN verify/decode recurrence: Pallas Mosaic GPU (`plgpu`) kernel, to compare with the Triton one.

Same semantics and contract as `reference.gdn_verify` and `recurrent.gdn_verify_pallas`. One CUDA
block (one warpgroup, 128 threads) per (request b, value head h, V-block j). It holds the
`[dk, BV]` float32 tile of the state h (= S^T, rows = keys) in registers in the WGMMA layout and
runs the T tokens (a static Python loop, T = 1+k <= 16), per token (docs/model_math.md#recurrence):

    h <- exp(g_t) h ;  h <- h + k_t (beta_t (v_t - h^T k_t))^T ;  o_t = h^T q_t

k_t and q_t are loaded as [dk] row vectors (`WGMMA.reduce(1)`: broadcasting them along the
columns is free), v_t and o_t are [BV] column vectors (`WGMMA.reduce(0)`); each h^T x is a
column sum, a cross-warp reduction through the small SMEM reduction scratch. No tensor cores:
every product is a matrix-vector one, and float32 WGMMA would round through tf32.

Memory traffic: the start tile pool[read_idx[b], h, :, j-block] comes in by TMA (GMEM -> SMEM ->
registers) and is fully loaded before any snapshot goes out, so the read slot may be one of the
write slots. Snapshot t is stored registers -> SMEM (double-buffered, 128-byte swizzle) -> TMA
to pool[write_idx[b, t], h, :, j-block], asynchronously, overlapping the next token; q/k/v, the
gates and the indices are plain (non-TMA) loads from GMEM, o_t a plain store.

Contract details, as the reference: value head h reads key head h // (HV // HK) (GVA); tokens
t >= num_valid[b] are inert: q/k/v/g/beta are replaced by zeros (selects, so garbage, even NaN,
never enters), hence the state is unchanged, its snapshot is still written to write_idx[b, t]
(as the reference does) and o_t = 0; has_state False starts from zeros; padding rows all write
the null slot 0, last writer wins. The pool is updated in place: the kernel writes a pool *Ref*
(`jax.new_ref`), which Pallas turns into an input/output alias (donate the pool under jit).

Limitations (honest): written for jax 0.11.x, where `pl.pallas_call` no longer lowers to Mosaic
GPU, so it is a `pl.kernel` over a `plgpu.Mesh` (also fine in 0.10.2), with the explicit-layout
"Lane" lowering semantics (0.11 defaults to "Warpgroup" semantics, whose select_n has no implicit
broadcast). On CPU it lowers to the Mosaic GPU custom call under jax 0.10.2 and 0.11.2 and matches
the reference in the Mosaic GPU interpreter of jax 0.11 (`interpret=plgpu.InterpretGPUParams()`; jax
0.10's interpreter cannot run `plgpu.load`). On the H200 (jax 0.11.2) its GPU tests pass; timed
beside the Triton kernel it was level to 1.5x slower, ahead only at batch 32, T >= 8
(docs/benchmarks.md, "Kernels (H200)"), so the Triton kernel is the default. Shapes: dk a multiple
of 64 (WGMMA row tiles), BV a multiple of 32 (one 128-byte swizzle row of float32) dividing dv; the
pool must be float32. Not tuned: the Lane lowering puts warpgroup barriers around every SMEM store,
each token does two cross-warp column sums through SMEM, the per-token q/k/v loads are synchronous,
one block per (b, h, j).
"""

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

F32 = jnp.float32
_SWIZZLE = 128  # bytes; a 128-byte swizzle row holds 32 float32 columns
_TILE = (8, _SWIZZLE // 4)  # SMEM tiling of a float32 state tile for that swizzle
_STATE = plgpu.Layout.WGMMA  # [dk, BV] register layout of the state tile
_ROW = plgpu.Layout.WGMMA.reduce(1)  # [dk] vectors, broadcast along the columns (k_t, q_t)
_COL = plgpu.Layout.WGMMA.reduce(0)  # [BV] vectors, broadcast along the rows (v_t, delta, o_t)
_GRID = ("b", "h", "j")


def _load(ref, layout):
    """Plain (non-TMA, unvectorised) load of a GMEM ref view into registers with `layout`."""
    if jax.__version_info__ < (0, 11):  # 0.10 requires the index argument, 0.11 deprecates it
        return plgpu.load(ref, None, layout=layout, optimized=False)
    return plgpu.load(ref, layout=layout, optimized=False)


def _verify_kernel(
    q_ref,  # [B, T, HK, dk]  GMEM, normalised and scaled
    k_ref,  # [B, T, HK, dk]  GMEM, normalised
    v_ref,  # [B, T, HV, dv]  GMEM
    g_ref,  # [B, T, HV] f32  GMEM, log decay
    beta_ref,  # [B, T, HV] f32 GMEM
    read_ref,  # [B] int32    GMEM, slot of the start state
    write_ref,  # [B, T] int32 GMEM, slot receiving the state after token t
    has_ref,  # [B] int32     GMEM, 0 -> start from zeros
    valid_ref,  # [B] int32   GMEM, num_valid
    pool_ref,  # [S, HV, dk, dv] f32 GMEM, read and written in place
    o_ref,  # [B, T, HV, dv] f32 GMEM output
    *,
    ratio: int,  # HV // HK
    block_v: int,
):
    b, h, j = (lax.axis_index(name) for name in _GRID)
    cols = pl.ds(j * block_v, block_v)
    num_tokens, dk = k_ref.shape[1], k_ref.shape[3]
    along_cols = functools.partial(lax.broadcast_in_dim, shape=(dk, block_v), broadcast_dimensions=(0,))
    along_rows = functools.partial(lax.broadcast_in_dim, shape=(dk, block_v), broadcast_dimensions=(1,))

    def token(ref, live, layout=None):  # one token's vector (or scalar) in float32, zeros if inert
        x = ref[...] if layout is None else _load(ref, layout)
        return jnp.where(live, x.astype(F32), 0.0)

    def body(state_smem, loaded):  # state_smem [2, dk, BV] f32 (swizzled), loaded: TMA barrier
        plgpu.copy_gmem_to_smem(pool_ref.at[read_ref[b], h, :, cols], state_smem.at[0], loaded)
        plgpu.barrier_wait(loaded)
        state = plgpu.layout_cast(state_smem[0], _STATE)  # [dk, BV]
        state = jnp.where(has_ref[b] != 0, state, 0.0)
        n_valid = valid_ref[b]
        for t in range(num_tokens):
            live = t < n_valid
            q = token(q_ref.at[b, t, h // ratio], live, _ROW)  # [dk]
            k = token(k_ref.at[b, t, h // ratio], live, _ROW)  # [dk]
            v = token(v_ref.at[b, t, h, cols], live, _COL)  # [BV]
            g, beta = token(g_ref.at[b, t, h], live), token(beta_ref.at[b, t, h], live)

            state = state * jnp.exp(g)
            pred = jnp.sum(state * along_cols(k), axis=0)  # [BV] = h^T k
            state = state + along_cols(k) * along_rows(beta * (v - pred))
            o_ref[b, t, h, cols] = jnp.sum(state * along_cols(q), axis=0)  # h^T q, after the update

            buf = state_smem.at[t % 2]
            if t >= 2:  # the snapshot of token t - 2 has left this buffer
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)
            buf[...] = state
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(buf, pool_ref.at[write_ref[b, t], h, :, cols])
        plgpu.wait_smem_to_gmem(0)

    transforms = (plgpu.TilingTransform(_TILE), plgpu.SwizzleTransform(_SWIZZLE))
    pl.run_scoped(body, plgpu.SMEM((2, dk, block_v), F32, transforms=transforms), plgpu.Barrier())


def _check(q, v, pool, block_v: int):
    hk, dk = q.shape[2:]
    hv, dv = v.shape[2:]
    if hv % hk:
        raise ValueError(f"value heads {hv=} must be a multiple of key heads {hk=}")
    if pool.shape[1:] != (hv, dk, dv) or pool.dtype != F32:
        raise ValueError(f"pool {pool.shape} {pool.dtype} must be float32 [S, {hv}, {dk}, {dv}]")
    if dk % 64 or block_v % _TILE[1] or dv % block_v:
        raise ValueError(f"{dk=} must be a multiple of 64 and {block_v=} a multiple of 32 dividing {dv=}")


def gdn_verify_mosaic(
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
    block_v: int = 32,
    interpret: Any = False,
) -> tuple[jax.Array, jax.Array]:
    """Mosaic GPU GDN verify/decode; same contract as `reference.gdn_verify`.

    Returns o [B, T, HV, dv] float32 and the pool with pool[write_idx[b, t]] = state after token t
    (in place when the caller donates the pool). `block_v` (static, a multiple of 32 dividing dv)
    is the V-block width of one CUDA block. Runs on sm_90+ GPUs; `interpret` takes a Mosaic GPU
    interpreter config (`plgpu.InterpretGPUParams()` in jax 0.11) to run it on CPU instead.
    """
    b, t, hk, dk = q.shape
    hv, dv = v.shape[2:]
    _check(q, v, pool, block_v)
    kernel = pl.kernel(
        functools.partial(_verify_kernel, ratio=hv // hk, block_v=block_v),
        out_type=jax.ShapeDtypeStruct((b, t, hv, dv), F32),
        mesh=plgpu.Mesh(grid=(b, hv, dv // block_v), grid_names=_GRID),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=interpret,
        name="gdn_verify_mosaic",
    )
    i32 = jnp.int32
    pool_ref = jax.new_ref(pool, memory_space=plgpu.GMEM)
    o = kernel(
        q, k, v, g.astype(F32), beta.astype(F32),
        read_idx.astype(i32), write_idx.astype(i32), has_state.astype(i32), num_valid.astype(i32),
        pool_ref,
    )
    return o, jax.freeze(pool_ref)
