"""GDN verify/decode recurrence: Pallas kernel (Triton lowering) with one state snapshot per token.

Same semantics as `reference.gdn_verify`. One program per (request, value head, V-block): it holds
the `[dk, BV]` float32 tile of the start state in registers and runs the T = 1+k tokens
(decode is T = 1), per token (docs/model_math.md#recurrence, state h = S^T):

    h <- exp(g_t) h ;  h <- h + k_t (beta_t (v_t - h^T k_t))^T ;  o_t = h^T q_t

then stores o_t and the snapshot h -> pool[write_idx[b, t]]: unrolled token by token
(`form="sequential"`), or as one loop over the tokens whose inputs were loaded as [T, ...] tiles
before the start (`form="loop"`, `_recur_loop`; the default for spans of 8 or more tokens at
64-column blocks, `default_form`), or computes the same outputs and snapshots from the span at once
(`form="chunk"`, `_chunk`; docs/model_math.md, "Verify span in chunk form"). A snapshot aimed at the
null slot 0 is not stored. The start tile is loaded from pool[read_idx[b]] before any store (the
read slot is one of the write slots), and the pool is updated in place through
`input_output_aliases` (the engine donates it). Every product here is a matrix-vector one, so the
kernel uses broadcasts and float32 reductions, no tensor-core dots. Its bytes are the state's (1
read + T writes of `[dk, dv]` per head); at batch 8 the snapshot stores are about half its time, at
batch 1 the chain of per-token reductions sets it (docs/benchmarks.md, "GDN verify: chunk form and
where the time goes").

Value head j reads key head j // (HV // HK) (GVA). Tokens t >= num_valid[b] are inert: their
q/k/v/g/beta are zeroed (as the reference does), so the state is unchanged and o_t = 0.

`gdn_verify_mixed_pallas` runs the same recurrence with the layer's glue inside (the contract of
`reference.gdn_verify_mixed`): it reads q, k and v in place from the conv output and computes the
q / k L2 norms and the gates g, beta of each token in registers, where XLA ran split, norm and gate
kernels between the conv and the recurrence (docs/benchmarks.md, "GDN glue inside the recurrence").
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.gated_delta import reference
from pallas_kernels.triton_common import fma, ignore_triton_deprecation, is_pow2, triton_compiler_params

F32 = jnp.float32


def _recur(h, tokens, o_ref, pool_out_ref, slots, compiled: bool):
    """Run the steps from the start tile h [dk, BV] over tokens[t] = (q, k, v, g, beta) in float32.

    The steps are unrolled (T = 1 + k is static) and every token's inputs are built before the first
    step: nothing in them depends on the state, so their loads (and the fused kernel's norms) are
    issued ahead of the chain of state updates instead of each paying its latency inside the chain.
    slots[t] is token t's snapshot slot, loaded by the caller with the inputs. Compiled, the rank-one
    update is one fused multiply-add per element (`fma`)."""
    for t, token in enumerate(tokens):
        h = _step(h, token, t, o_ref, pool_out_ref, slots[t], compiled)


def _step(h, token, t, o_ref, pool_out_ref, slot, compiled: bool):
    """One token's step from h [dk, BV]: decay, delta-rule update, readout o_t, snapshot to slot."""
    q, k, v, g, beta = token
    h = h * jnp.exp(g)
    pred = jnp.sum(h * k[:, None], axis=0)  # [BV] = h^T k
    h = fma(k[:, None], (beta * (v - pred))[None, :], h, compiled=compiled)
    o_ref[t] = jnp.sum(h * q[:, None], axis=0).astype(o_ref.dtype)  # h^T q, after the update
    _store(pool_out_ref, slot, h)
    return h


def _recur_loop(h, span, o_ref, pool_out_ref, write_ref, compiled: bool):
    """The steps of `_recur` as one loop over the tokens (form "loop"): span = (q, k, v, g, beta) as
    [T, dk], [T, dk], [T, BV], [T], [T] float32 tiles built before the loop; each step picks its
    token's rows out of them. One step's code instead of T unrolled copies (the unrolled form's
    instructions outgrow the instruction cache at T = 8: docs/benchmarks.md, "Hardware counters of
    the decode projections and the GDN verify")."""
    rows = jnp.arange(span[0].shape[0])

    def step(t, h):
        token = [jnp.sum(jnp.where(rows[:, None] == t, x, 0.0), axis=0) for x in span[:3]]
        token += [jnp.sum(jnp.where(rows == t, x, 0.0)) for x in span[3:]]
        return _step(h, token, t, o_ref, pool_out_ref, write_ref[t], compiled)

    jax.lax.fori_loop(0, rows.shape[0], step, h)


def _store(pool_out_ref, slot, h):
    """Snapshot h -> pool[slot], except at the null slot 0, whose writes the reference drops too
    (`reference.set_rows`): padding rows and inert tokens (the layer points them there) store nothing."""

    @pl.when(slot != 0)
    def _():
        pool_out_ref[slot] = h.astype(pool_out_ref.dtype)


def _mm(a, b):
    """[M, K] @ [K, N] as a broadcast product and a float32 reduction: the span's matrices have T
    (< 16, the smallest tensor-core tile) rows."""
    return jnp.sum(a[:, :, None] * b[None, :, :], axis=1)


def _chunk(h, span, rows, o_ref, pool_out_ref, write_ref, barrier: bool):
    """The same T steps in chunk form (docs/model_math.md#verify-span-in-chunk-form): no reduction
    waits on the state chain.

    span = (Q, K, V, g, beta, scale): [T, dk], [T, dk], [T, BV], [T], [T], [T] in float32 (q, k
    normalised, zero for inert tokens; K = scale * k as loaded). rows(t) -> (k_t, g_t): token t's k
    as loaded (zero if inert) and its log decay, for the snapshot chain. With G the inclusive
    cumulative sum of g and D[t, s] = exp(G_t - G_s) for s <= t, the per-token writes
    u_t = beta_t (v_t - pred_t) solve the unit lower triangular system
    (I + A) U = beta (V - exp(G) K h0), A[t, s] = beta_t D[t, s] k_t.k_s (s < t); the readout is
    O = exp(G) Q h0 + (D * Q K^T) U, and the snapshots are the elementwise chain
    h_t = exp(g_t) h_{t-1} + k_t u_t^T. The u_t reach that chain through o (stored, then read back
    row by row after a barrier) before o receives the readout."""
    Q, K, V, g, beta, scale = span
    T = Q.shape[0]
    t_idx = jnp.arange(T)
    row, col = t_idx[:, None], t_idx[None, :]
    G = jnp.sum(jnp.where(col <= row, g[None, :], 0.0), axis=1)
    D = jnp.exp(jnp.where(col <= row, G[:, None] - G[None, :], -jnp.inf))  # [T, T], zero above the diagonal
    A = jnp.where(col < row, beta[:, None] * D * jnp.sum(K[:, None, :] * K[None, :, :], axis=2), 0.0)
    inv = reference.unit_lower_inverse(A, matmul=_mm)  # (I + A)^-1 by block doubling, as the prefill
    decayed = jnp.exp(G)[:, None]
    U = _mm(inv, beta[:, None] * (V - decayed * jnp.sum(K[:, :, None] * h[None, :, :], axis=1)))  # [T, BV]
    qk = jnp.sum(Q[:, None, :] * K[None, :, :], axis=2)  # [T, T]
    readout = decayed * jnp.sum(Q[:, :, None] * h[None, :, :], axis=1) + _mm(D * qk, U)
    chain = [rows(t) for t in range(T)]
    o_ref[...] = (U * scale[:, None]).astype(o_ref.dtype)  # k_t u_t^T = (k as loaded) (scale_t u_t)^T
    if barrier:  # every row of U is stored before any thread reads one back
        pltriton.debug_barrier()
    writes = [o_ref[t].astype(F32) for t in range(T)]
    if barrier:  # every thread holds its rows before the readout overwrites them
        pltriton.debug_barrier()
    o_ref[...] = readout.astype(o_ref.dtype)
    for t, (k, g_t) in enumerate(chain):
        h = h * jnp.exp(g_t) + k[:, None] * writes[t][None, :]
        _store(pool_out_ref, write_ref[t], h)


def _start(pool_ref, read_ref, has_ref, barrier: bool):
    """The start tile pool[read] in float32 (zeros without a state), held before any snapshot is stored."""
    h = pool_ref[read_ref[0]].astype(F32)  # [dk, BV]
    h = jnp.where(has_ref[0] != 0, h, 0.0)
    if barrier:  # every thread holds its part of the start tile before any snapshot is stored
        pltriton.debug_barrier()
    return h


def _span(refs, live):
    """refs' whole [T, ...] tiles in float32, zero in the rows of inert tokens (live [T] False)."""
    return [jnp.where(live[(slice(None),) + (None,) * (ref.ndim - 1)], ref[...].astype(F32), 0.0) for ref in refs]


def _loads(refs, valid_ref, write_ref):
    """Every per-token load of a sequential walk, issued together: ([T] tuples of refs[i][t] as
    stored, num_valid, [T] snapshot slots). The caller makes them before `_start`, whose barrier
    waits for the loads issued ahead of it, so the inputs' latency runs beside the start tile's
    instead of after it, and no token's loads wait behind an earlier token's norm reductions (the
    ncu profile in docs/benchmarks.md, "Hardware counters of the decode projections and the GDN
    verify")."""
    T = refs[0].shape[0]
    return [tuple(ref[t] for ref in refs) for t in range(T)], valid_ref[0], [write_ref[t] for t in range(T)]


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
    form: str,
):
    T = q_ref.shape[0]
    if form == "chunk":
        h = _start(pool_ref, read_ref, has_ref, barrier)

        def token(t):  # token t's inputs in float32, zero for an inert token
            live = t < valid_ref[0]
            return tuple(jnp.where(live, ref[t].astype(F32), 0.0) for ref in (q_ref, k_ref, v_ref, g_ref, beta_ref))

        span = _span((q_ref, k_ref, v_ref, g_ref, beta_ref), jnp.arange(T) < valid_ref[0])
        rows = lambda t: token(t)[1:4:2]  # (k_t, g_t), k already normalised  # noqa: E731
        _chunk(h, (*span, jnp.ones((T,), F32)), rows, o_ref, pool_out_ref, write_ref, barrier)
        return
    if form == "loop":  # the span's loads issued before the start tile's barrier, as `_loads`
        span = _span((q_ref, k_ref, v_ref, g_ref, beta_ref), jnp.arange(T) < valid_ref[0])
        _recur_loop(_start(pool_ref, read_ref, has_ref, barrier), span, o_ref, pool_out_ref, write_ref, barrier)
        return
    raw, valid, slots = _loads((q_ref, k_ref, v_ref, g_ref, beta_ref), valid_ref, write_ref)
    h = _start(pool_ref, read_ref, has_ref, barrier)
    tokens = [tuple(jnp.where(t < valid, x.astype(F32), 0.0) for x in raw[t]) for t in range(T)]
    _recur(h, tokens, o_ref, pool_out_ref, slots, compiled=barrier)


def _verify_mixed_kernel(
    q_ref,  # [T, dk]        the conv output's q channels of key head h // r (raw)
    k_ref,  # [T, dk]        its k channels (raw)
    v_ref,  # [T, BV]        this value head's channels, this V-block
    a_ref,  # [T]            a projection of this value head
    b_ref,  # [T]            b projection
    a_log_ref,  # [1]        A_log of this value head
    dt_bias_ref,  # [1]      dt_bias of this value head
    pool_ref, read_ref, write_ref, has_ref, valid_ref, o_ref, pool_out_ref,  # as _verify_kernel
    *,
    barrier: bool,
    form: str,
):
    T, dk = q_ref.shape
    decay = -jnp.exp(a_log_ref[0].astype(F32))
    dt_bias = dt_bias_ref[0].astype(F32)

    def gates(a, b, live):  # reference.gates of raw a / b (scalars or [T]), zero where inert
        x = a.astype(F32) + dt_bias
        g = jnp.where(live, decay * (jnp.maximum(x, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(x)))), 0.0)  # softplus
        return g, jnp.where(live, 1.0 / (1.0 + jnp.exp(-b.astype(F32))), 0.0)  # sigmoid

    def inverse_norm(x, axis):  # 1 / |x| along axis, as reference.l2norm
        return jax.lax.rsqrt(jnp.sum(x * x, axis=axis) + 1e-6)

    if form == "chunk":
        h = _start(pool_ref, read_ref, has_ref, barrier)
        live = jnp.arange(T) < valid_ref[0]
        q, k, v = _span((q_ref, k_ref, v_ref), live)
        scale = inverse_norm(k, 1)
        span = (q * (inverse_norm(q, 1) * dk ** -0.5)[:, None], k * scale[:, None], v,
                *gates(a_ref[...], b_ref[...], live), scale)

        def rows(t):  # k_t as loaded and g_t
            live_t = t < valid_ref[0]
            return jnp.where(live_t, k_ref[t].astype(F32), 0.0), gates(a_ref[t], b_ref[t], live_t)[0]

        _chunk(h, span, rows, o_ref, pool_out_ref, write_ref, barrier)
        return
    if form == "loop":
        live = jnp.arange(T) < valid_ref[0]
        q, k, v = _span((q_ref, k_ref, v_ref), live)
        g, beta = gates(a_ref[...], b_ref[...], live)
        h = _start(pool_ref, read_ref, has_ref, barrier)
        span = (q * (inverse_norm(q, 1) * dk ** -0.5)[:, None], k * inverse_norm(k, 1)[:, None], v, g, beta)
        _recur_loop(h, span, o_ref, pool_out_ref, write_ref, barrier)
        return
    raw, valid, slots = _loads((q_ref, k_ref, v_ref, a_ref, b_ref), valid_ref, write_ref)
    h = _start(pool_ref, read_ref, has_ref, barrier)
    scales = jnp.where(jnp.arange(2) == 0, dk ** -0.5, 1.0).astype(F32)  # q is also scaled by dk^-1/2

    def token(t):  # reference.gdn_inputs for token t, zero for an inert token
        live = t < valid
        q, k, v, a, b = raw[t]
        qk = jnp.where(live, jnp.stack([q, k], axis=-1).astype(F32), 0.0)  # [dk, 2]: both norms in one reduction
        q, k = jnp.unstack(qk * (inverse_norm(qk, 0) * scales)[None, :], axis=-1)
        return q, k, jnp.where(live, v.astype(F32), 0.0), *gates(a, b, live)

    _recur(h, [token(t) for t in range(T)], o_ref, pool_out_ref, slots, compiled=barrier)


# V-block width: 32 columns; 64 once the grid has this many programs at 64 columns (or LOOP_MIN_PROGRAMS
# for a span that takes the loop form, below); 16 for a verify span (T > 1) whose grid at 32 columns is
# small. Busy time per call on one H200 (docs/benchmarks.md, "GDN verify blocks" and "GDN verify blocks
# at batch 1"): 64 columns cut 7-10% at batch 32 and at Qwen3.5-27B batch 8, and cost 20-70% where the
# grid is small (Qwen3.5-2B batch 8, batch 1); at batch 1, T = 8, 16 columns cut 6-16% on the 2B, 27B
# and Next layouts (both kernels); at T = 1 they match 32 or lose 4%.
WIDE_BLOCK_V, WIDE_MIN_PROGRAMS = 64, 512
NARROW_BLOCK_V, NARROW_MAX_PROGRAMS = 16, 256  # programs counted at 32 columns


def default_block_v(b: int, hv: int, dv: int, t: int = 1) -> int:
    """V-block width for b requests of hv value heads, dv columns each, t tokens per request."""
    if dv % WIDE_BLOCK_V == 0 and b * hv * (dv // WIDE_BLOCK_V) >= WIDE_MIN_PROGRAMS:
        return WIDE_BLOCK_V
    if loop_span(t) and dv % WIDE_BLOCK_V == 0 and b * hv * (dv // WIDE_BLOCK_V) >= LOOP_MIN_PROGRAMS:
        return WIDE_BLOCK_V
    if t > 1 and dv % 32 == 0 and b * hv * (dv // 32) < NARROW_MAX_PROGRAMS:
        return NARROW_BLOCK_V
    return min(32, dv)


# How a program walks a verify span: token by token, or in chunk form (`_chunk`) from CHUNK_MIN_T tokens
# on (None: never). On an H100 the chunk form lost at T = 8 on every layout (1.3-2.1x the sequential busy
# time; Qwen3.5-2B verify round +77 us) and won only at batch 1, T = 2 / 4 on the 2B heads (by 0.4-0.5 us):
# docs/benchmarks.md, "GDN verify: chunk form and where the time goes": no span takes it by default.
# The loop form (`_recur_loop`: the span's inputs loaded as tiles before the start barrier, then a loop
# over its tokens) runs 64-column blocks of spans of LOOP_MIN_T or more tokens (a power of two), and
# `default_block_v` gives such spans 64 columns once the grid has LOOP_MIN_PROGRAMS programs at that
# width. H100, T = 8 (docs/benchmarks.md, "GDN verify: the loop form"): at 64 columns the loop form beat
# the sequential one on every layout and batch timed (27B batch 8: 90.5 -> 81.3 us busy, 1.07x the
# floor; 2B batch 8: 34.1 -> 29.6, and 36.4 at the 32 columns it had before; batch 1: 22.9 -> 17.5 and
# 19.6 -> 16.5), but at batch 1 (96 and 32 programs at 64 columns) the 16-column sequential walk stays
# ahead (12.9 and 7.6 us). T = 16 was not timed.
FORMS = ("sequential", "chunk", "loop")
CHUNK_MIN_T = None
LOOP_MIN_T, LOOP_MIN_PROGRAMS = 8, 256


def loop_span(t: int) -> bool:
    """Whether spans of t tokens take the loop form at 64-column blocks (t >= LOOP_MIN_T, a power of two)."""
    return t >= LOOP_MIN_T and is_pow2(t)


def default_form(t: int, block_v: int | None = None) -> str:
    """The form for spans of t tokens in blocks of block_v columns (chunk and loop need t a power of two)."""
    if block_v is not None and block_v >= WIDE_BLOCK_V and loop_span(t):
        return "loop"
    return "chunk" if CHUNK_MIN_T is not None and t >= CHUNK_MIN_T and is_pow2(t) else "sequential"


def _check(q, v, pool, block_v: int):
    hk, dk = q.shape[2:]
    hv, dv = v.shape[2:]
    if hv % hk:
        raise ValueError(f"value heads {hv=} must be a multiple of key heads {hk=}")
    if pool.shape[1:] != (hv, dk, dv):
        raise ValueError(f"pool shape {pool.shape} must be [S, {hv}, {dk}, {dv}]")
    if not (is_pow2(dk) and is_pow2(block_v) and dv % block_v == 0):
        raise ValueError(f"{dk=} and {block_v=} must be powers of two, block_v dividing {dv=} (Triton tiles)")


def _call(kernel, inputs, in_specs, pool, step, *, grid, o_shape, block_v: int, num_warps: int, form: str | None,
          interpret: bool, name: str):
    """The verify pallas_call: `inputs` with their `in_specs`, then the pool and the step scalars
    (read_idx [B], write_idx [B, T], has_state [B], num_valid [B]); o [B, T, HV, dv] float32 and the
    pool aliased in place."""
    t, dk = o_shape[1], pool.shape[2]
    form = form or default_form(t, block_v)
    if form not in FORMS:
        raise ValueError(f"form {form!r} is not one of {FORMS}")
    if form in ("chunk", "loop") and not interpret and not is_pow2(t):
        raise ValueError(f"form {form!r} loads the span as one [T, dk] tile: T = {t} must be a power of two "
                         "(Triton tensor sizes); form 'sequential' takes any T")
    pool_spec = pl.BlockSpec((pool.shape[0], None, dk, block_v), lambda i, h, j: (0, h, 0, j))
    scalar_spec = pl.BlockSpec((1,), lambda i, h, j: (i,))
    out_spec = pl.BlockSpec((None, t, None, block_v), lambda i, h, j: (i, 0, h, j))
    call = pl.pallas_call(
        functools.partial(kernel, barrier=not interpret, form=form),
        grid=grid,
        in_specs=[*in_specs, pool_spec, scalar_spec, pl.BlockSpec((None, t), lambda i, h, j: (i, 0)), scalar_spec,
                  scalar_spec],
        out_specs=[out_spec, pool_spec],
        out_shape=[jax.ShapeDtypeStruct(o_shape, F32), jax.ShapeDtypeStruct(pool.shape, pool.dtype)],
        input_output_aliases={len(inputs): 1},
        compiler_params=triton_compiler_params(num_warps, num_stages=1),
        interpret=interpret,
        name=name,
    )
    with ignore_triton_deprecation():
        return call(*inputs, pool, *(x.astype(jnp.int32) for x in step))


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
    form: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Pallas GDN verify/decode; same contract as `reference.gdn_verify`.

    Returns o [B, T, HV, dv] float32 and the pool with pool[write_idx[b, t]] = state after token t
    for every slot but the null slot 0, which is never stored (`_store`; the reference drops it).
    `block_v` (static, power of two dividing dv; None: `default_block_v`) is the V-block width of
    one program; `form` (static, one of `FORMS`; None: `default_form`) how a program walks the T
    tokens: "sequential" steps the recurrence token by token, "chunk" solves the span at once
    (`_chunk`). `interpret=True` is required on CPU.
    """
    b, t, hk, dk = q.shape
    hv, dv = v.shape[2:]
    block_v = block_v or default_block_v(b, hv, dv, t)
    _check(q, v, pool, block_v)
    r = hv // hk
    key_spec = pl.BlockSpec((None, t, None, dk), lambda i, h, j: (i, 0, h // r, 0))
    value_spec = pl.BlockSpec((None, t, None, block_v), lambda i, h, j: (i, 0, h, j))
    gate_spec = pl.BlockSpec((None, t, None), lambda i, h, j: (i, 0, h))
    return _call(_verify_kernel, (q, k, v, g, beta), [key_spec, key_spec, value_spec, gate_spec, gate_spec], pool,
                 (read_idx, write_idx, has_state, num_valid), grid=(b, hv, dv // block_v), o_shape=v.shape,
                 block_v=block_v, num_warps=num_warps, form=form, interpret=interpret, name="gdn_verify")


def mixed_fits(dk: int, dv: int, block_v: int) -> bool:
    """Whether `gdn_verify_mixed_pallas` reads these heads in place: dk and block_v powers of two,
    block_v dividing dv and 2 dk (a value head's columns start on a V-block boundary)."""
    return is_pow2(dk) and is_pow2(block_v) and dv % block_v == 0 and (2 * dk) % block_v == 0


def check_gate_channels(a, b, a_at: int, b_at: int, hv: int, batch_tokens: tuple[int, int]) -> None:
    """a and b ([B, T, *]) must hold hv channels from a_at and b_at."""
    for name, x, at in (("a", a, a_at), ("b", b, b_at)):
        if x.ndim != 3 or tuple(x.shape[:2]) != tuple(batch_tokens) or not 0 <= at <= x.shape[2] - hv:
            raise ValueError(f"{name} shape {x.shape} with {name}_at={at} must be [{batch_tokens[0]}, "
                             f"{batch_tokens[1]}, C] holding {hv} channels from {name}_at (0 <= {name}_at <= C - {hv})")


def gdn_verify_mixed_pallas(
    mixed: jax.Array,  # [B, T, HK * (2 dk + r dv)] conv output, channels grouped per key head
    a: jax.Array,  # [B, T, >= a_at + HV] a projection (pre-activation) in channels a_at .. a_at + HV
    b: jax.Array,  # [B, T, >= b_at + HV] b projection (pre-activation), likewise
    a_log: jax.Array,  # [HV]
    dt_bias: jax.Array,  # [HV]
    pool: jax.Array,  # [S, HV, dk, dv] float32 state pool (slot 0 = null slot)
    read_idx: jax.Array,  # [B] int32
    write_idx: jax.Array,  # [B, T] int32
    has_state: jax.Array,  # [B] bool
    num_valid: jax.Array,  # [B] int32
    *,
    a_at: int = 0,
    b_at: int = 0,
    interpret: bool = False,
    block_v: int | None = None,
    num_warps: int = 4,
    form: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """`gdn_verify_pallas` with the layer's glue inside: same contract as `reference.gdn_verify_mixed`
    on a[..., a_at:a_at + HV] and b[..., b_at:b_at + HV].

    Each program reads its key head's q / k channels and its value head's V-block straight from the
    conv output (no split copies) and its head's a / b channels from where they lie (a and b may be
    one packed projection output, jaxspec/models/packing.py), L2-normalises q and k and computes g and
    beta per token in registers (the normalisation is repeated by the r * dv / block_v programs that
    share a key head: dk multiply-adds per token each). dk, dv come from the pool; `block_v` as
    `gdn_verify_pallas`, also dividing 2 dk (`mixed_fits`); `form` as `gdn_verify_pallas`."""
    batch, t, channels = mixed.shape
    hv, dk, dv = pool.shape[1:]
    hk = reference.key_heads(channels, hv, dk, dv)
    block_v = block_v or default_block_v(batch, hv, dv, t)
    if not mixed_fits(dk, dv, block_v):
        raise ValueError(f"{dk=} and {block_v=} must be powers of two, block_v dividing {dv=} and 2 * dk (Triton "
                         "tiles reading the conv output in place)")
    check_gate_channels(a, b, a_at, b_at, hv, (batch, t))
    for name, x, shape in (("a_log", a_log, (hv,)), ("dt_bias", dt_bias, (hv,))):
        if x.shape != shape:
            raise ValueError(f"{name} shape {x.shape} must be {shape} for mixed {mixed.shape} and pool {pool.shape}")
    r, vb = hv // hk, dv // block_v
    first_v = 2 * dk // block_v  # V-block index of a key head's first value column
    key_spec = lambda part: pl.BlockSpec((None, t, None, dk), lambda i, h, j: (i, 0, h // r, part))  # noqa: E731
    value_spec = pl.BlockSpec((None, t, None, block_v), lambda i, h, j: (i, 0, h // r, first_v + (h % r) * vb + j))
    gate_spec = lambda at: pl.BlockSpec((None, t, None), lambda i, h, j: (i, 0, at + h))  # noqa: E731
    head_spec = pl.BlockSpec((1,), lambda i, h, j: (h,))
    grouped = mixed.reshape(batch, t, hk, channels // hk)
    return _call(_verify_mixed_kernel, (grouped, grouped, grouped, a, b, a_log, dt_bias),
                 [key_spec(0), key_spec(1), value_spec, gate_spec(a_at), gate_spec(b_at), head_spec, head_spec], pool,
                 (read_idx, write_idx, has_state, num_valid), grid=(batch, hv, vb), o_shape=(batch, t, hv, dv),
                 block_v=block_v, num_warps=num_warps, form=form, interpret=interpret, name="gdn_verify_mixed")
