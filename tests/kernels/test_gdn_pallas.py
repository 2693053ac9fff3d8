"""Pallas Gated DeltaNet kernels vs the pure-JAX references (pallas_kernels/gated_delta/reference.py).

On CPU the kernels run in interpret mode on small heads (dk = dv = 16); on a GPU the same checks
compile them with Triton on Qwen shapes (dk = dv = 128, HK = 16, HV = 16/32/48). Outputs are
compared by relative RMS, rms(a - b) / rms(b), with a tolerance set by the dtype of the compared
array, not of the inputs: < 1e-5 for float32 (o and the state pools are float32 whatever the input
dtype; measured in interpret mode: <= 1e-7, and 0 for verify with bfloat16 inputs), < 5e-3 for the
bfloat16 conv output (about one bfloat16 rounding, 2^-8). Pools are compared on every slot but the null slot 0 (padding
rows all write there, in an unspecified order); conv lines must match exactly.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import ops
from pallas_kernels.gated_delta import api
from pallas_kernels.gated_delta import chunk as C
from pallas_kernels.gated_delta import reference as R
from pallas_kernels.gated_delta.chunk import gdn_prefill_pallas
from pallas_kernels.gated_delta.conv import conv_update_pallas
from pallas_kernels.gated_delta.recurrent import FORMS, default_block_v, gdn_verify_pallas

ON_GPU = jax.default_backend() == "gpu"
INTERPRET = not ON_GPU
RTOL = {"float32": 1e-5, "bfloat16": 5e-3}  # by the dtype of the compared output
# The prefill's reduced-precision dot modes round their float32 operands (TF32: 10 mantissa bits,
# bfloat16: 7), so their outputs are held to twice that unit roundoff (2^-11, 2^-8), not float32's.
DOTS_RTOL = {"tf32": 2 * 2.0**-11, "bf16": 2 * 2.0**-8}
SMALL = {"hk": 2, "dk": 16, "dv": 16}  # interpret-mode heads: HV = 2 r
QWEN = {"hk": 16, "dk": 128, "dv": 128}  # GPU heads: HV = 16 r (Qwen3.5-2B / Next / 27B for r = 1 / 2 / 3)

verify_ref = jax.jit(R.gdn_verify)
prefill_ref = jax.jit(R.gdn_prefill, static_argnames="chunk_size")
conv_ref = jax.jit(R.conv_update, static_argnames="mode")
verify_pallas = jax.jit(gdn_verify_pallas, static_argnames=("interpret", "block_v", "form"))
prefill_pallas = jax.jit(gdn_prefill_pallas, static_argnames=("chunk_size", "interpret", "block_v", "f32_dots"))
conv_pallas = jax.jit(conv_update_pallas, static_argnames=("mode", "interpret", "block_c", "block_t", "tail"))


def rel_rms(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b**2)))


def assert_close(got, want, dtype, tol=None):
    """rel_rms(got, want) within the tolerance of want's dtype (dtype, the inputs' dtype, does not
    loosen it: a float32 output of bfloat16 inputs is held to float32's tolerance), or within
    `tol` where the kernel was asked to round (DOTS_RTOL)."""
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    tol = max(tol or 0.0, RTOL[np.dtype(want.dtype).name])
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape and np.isfinite(got).all()
    err = rel_rms(got, want)
    assert err < tol, f"relative RMS error {err:.3g} >= {tol:g} ({np.dtype(dtype).name} inputs)"


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def gdn_inputs(rng, num_valid, T, *, hk, hv, dk, dv, dtype, gates="normal"):
    """q, k [B, T, hk, dk] (normalised, q scaled), v [B, T, hv, dv], beta [B, T, hv] in dtype and
    g [B, T, hv] float32. Tokens t >= num_valid[b] hold garbage that only masking keeps out."""
    B = len(num_valid)
    q = np.array(R.l2norm(rng.standard_normal((B, T, hk, dk)))) * dk**-0.5
    k = np.array(R.l2norm(rng.standard_normal((B, T, hk, dk))))
    v = rng.standard_normal((B, T, hv, dv))
    if gates == "normal":
        g, beta = np.log(_sigmoid(rng.standard_normal((B, T, hv)))), _sigmoid(rng.standard_normal((B, T, hv)))
    else:  # half the tokens forget everything, half keep everything; beta near 1
        g = np.where(rng.random((B, T, hv)) < 0.5, -50.0, -1e-7)
        beta = 1.0 - rng.uniform(0.0, 1e-4, (B, T, hv))
    for b, n in enumerate(num_valid):
        q[b, n:], k[b, n:], v[b, n:] = 10.0, -10.0, 1e3
        g[b, n:], beta[b, n:] = 5.0, 3.0
    cast = lambda x: jnp.asarray(np.asarray(x, np.float32), dtype)  # noqa: E731
    return cast(q), cast(k), cast(v), jnp.asarray(g, jnp.float32), cast(beta)


def i32(*xs):
    return jnp.asarray(xs, jnp.int32)


# ----------------------------------------------------------------------------------------------
# Verify / decode recurrence
# ----------------------------------------------------------------------------------------------


def verify_rounds(rng, T: int, hv: int, dk: int, dv: int, new_inputs, both):
    """Rows: request A (all T tokens valid), B (T - 2 valid), C (fresh, has_state False), padding.
    Round 1 reads slots holding junk states; round 2 runs once per acceptance count a = 1..T, with
    A reading its snapshot base_A + a - 1 (B and C likewise, clipped to their valid tokens).
    new_inputs(num_valid) -> a step's inputs; both(inputs, pool, (read, write, has_state, num_valid))
    checks the kernel and returns the reference's pool."""
    bases = [1, 1 + T, 1 + 2 * T]  # engine slots 1..3 own state slots base .. base + T - 1
    num_valid = [T, max(1, T - 2), T, 0]
    pool = jnp.asarray(rng.standard_normal((1 + 3 * T, hv, dk, dv)) * 0.5, jnp.float32)
    write = jnp.asarray([[b + t for t in range(T)] for b in bases] + [[0] * T], jnp.int32)
    first = (i32(bases[0] + T - 1, bases[1], 0, 0), write, jnp.asarray([True, True, False, False]), i32(*num_valid))
    pool = both(new_inputs(num_valid), pool, first)
    inputs = new_inputs(num_valid)
    for a in range(1, T + 1):
        read = i32(*(base + min(a, n) - 1 for base, n in zip(bases, num_valid[:3], strict=True)), 0)
        both(inputs, pool, (read, write, jnp.asarray([True, True, True, False]), i32(*num_valid)))


def check_verify(seed, *, k, r, dtype, interpret, block_v=None, form=None, hk, dk, dv):
    """`verify_rounds` of the Pallas kernel (in `form`) against the reference."""
    rng = np.random.default_rng(seed)
    T, hv = 1 + k, hk * r

    def both(inputs, pool, step):
        args = (*inputs, pool, *step)
        got, want = verify_pallas(*args, interpret=interpret, block_v=block_v, form=form), verify_ref(*args)
        assert_close(got[0], want[0], dtype)
        assert_close(got[1][1:], want[1][1:], dtype)
        np.testing.assert_array_equal(got[1][0], pool[0], "the padding row stored into the null slot")
        assert not np.asarray(got[0][3]).any(), "padding row reads out zeros"
        return want[1]

    verify_rounds(rng, T, hv, dk, dv, lambda nv: gdn_inputs(rng, nv, T, hk=hk, hv=hv, dk=dk, dv=dv, dtype=dtype), both)


def test_default_block_v_widens_only_a_full_grid():
    assert default_block_v(1, 48, 128) == 32  # Qwen3.5-27B, batch 1: 96 programs at 64 columns
    assert default_block_v(8, 16, 128) == 32  # Qwen3.5-2B, batch 8: 256
    assert default_block_v(8, 48, 128) == 64  # Qwen3.5-27B, batch 8: 768
    assert default_block_v(32, 16, 128) == 64
    assert default_block_v(64, 16, 16) == 16  # narrower than 32 columns: the whole width
    assert default_block_v(64, 16, 96) == 32  # 64 does not divide 96


def test_default_form_loops_over_long_spans_of_wide_blocks():
    """The loop form for spans of >= LOOP_MIN_T tokens (a power of two) at 64-column blocks; the
    sequential walk otherwise (the chunk form is never a default)."""
    from pallas_kernels.gated_delta.recurrent import LOOP_MIN_T, default_form

    assert LOOP_MIN_T == 8
    assert default_form(8, 64) == default_form(16, 64) == "loop"
    assert default_form(8, 32) == default_form(8, 16) == default_form(8) == "sequential"
    assert default_form(4, 64) == default_form(12, 64) == default_form(1, 64) == "sequential"
    # what the model's verify picks: Qwen3.5-27B / 2B heads at batch 8, k = 7 loop; batch 1 does not
    for b, hv, form in ((8, 48, "loop"), (8, 16, "loop"), (1, 48, "sequential"), (1, 16, "sequential")):
        assert default_form(8, default_block_v(b, hv, 128, 8)) == form, (b, hv)


def test_default_block_v_narrows_a_small_verify_grid():
    assert default_block_v(1, 16, 128, 8) == 16  # Qwen3.5-2B, batch 1, k = 7: 64 programs at 32 columns
    assert default_block_v(1, 48, 128, 8) == 16  # Qwen3.5-27B: 192
    assert default_block_v(1, 16, 128, 1) == 32  # decode keeps 32 (equal busy time)
    assert default_block_v(8, 16, 128, 8) == 64  # 256 programs at 64 columns: the loop form's width
    assert default_block_v(8, 16, 128, 2) == 32  # T = 2: no loop form, 512 programs at 32: not small
    assert default_block_v(8, 16, 128, 6) == 32  # T = 6 is not a power of two
    assert default_block_v(4, 16, 128, 8) == 32  # 128 programs at 64 columns: too few for the loop form
    assert default_block_v(8, 48, 128, 8) == 64  # a full grid widens as before
    assert default_block_v(1, 4, 16, 8) == 16  # narrower than 32 columns: the whole width


# Each (k, r) point is one compile; the pairs cover every k and every GVA ratio.
VERIFY_CASES = [(0, 1), (1, 2), (3, 3), (7, 1), (15, 2)]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize(("k", "r"), VERIFY_CASES)
def test_verify_interpret_float32(k, r, form):
    check_verify(k, k=k, r=r, dtype=jnp.float32, interpret=True, block_v=8, form=form, **SMALL)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize(("k", "r"), [(3, 2), (7, 3)])
def test_verify_interpret_bfloat16(k, r, form):
    check_verify(100 + k, k=k, r=r, dtype=jnp.bfloat16, interpret=True, form=form, **SMALL)


def test_unknown_form_is_refused():
    rng = np.random.default_rng(0)
    inputs = gdn_inputs(rng, [2], 2, hk=2, hv=2, dk=8, dv=8, dtype=jnp.float32)
    pool = jnp.zeros((3, 2, 8, 8), jnp.float32)
    with pytest.raises(ValueError, match=r"form 'parallel' is not one of \('sequential', 'chunk', 'loop'\)"):
        gdn_verify_pallas(*inputs, pool, i32(1), i32([1, 2]), jnp.asarray([True]), i32(2), interpret=True,
                          form="parallel")


def test_chunk_form_refuses_a_span_triton_cannot_tile():
    rng = np.random.default_rng(0)
    inputs = gdn_inputs(rng, [3], 3, hk=2, hv=2, dk=8, dv=8, dtype=jnp.float32)
    pool = jnp.zeros((4, 2, 8, 8), jnp.float32)
    with pytest.raises(ValueError, match="T = 3 must be a power of two"):  # refused before any lowering
        gdn_verify_pallas(*inputs, pool, i32(1), i32([1, 2, 3]), jnp.asarray([True]), i32(3), interpret=False,
                          form="chunk")


# ----------------------------------------------------------------------------------------------
# Chunked prefill
# ----------------------------------------------------------------------------------------------


def check_prefill(seed, *, T, chunk, r, dtype, interpret, block_v=None, gates="normal", hk, dk, dv,
                  f32_dots=None):
    """Rows: fresh full row (slot 1), a continuation of chunk + 1 tokens (reads 2, writes 3), one of
    exactly one chunk (slot 4), a padding row; slot 5 must stay untouched. Held to the tolerance of
    `f32_dots` (DOTS_RTOL; default: the kernel's for this dtype) where compiled."""
    rng = np.random.default_rng(seed)
    hv = hk * r
    num_valid = [T, min(T, chunk + 1), min(T, chunk), 0]
    inputs = gdn_inputs(rng, num_valid, T, hk=hk, hv=hv, dk=dk, dv=dv, dtype=dtype, gates=gates)
    pool = jnp.asarray(rng.standard_normal((6, hv, dk, dv)) * 0.5, jnp.float32)
    args = (*inputs, pool, i32(1, 2, 4, 0), i32(1, 3, 4, 0), jnp.asarray([False, True, True, True]), i32(*num_valid))
    got = prefill_pallas(*args, chunk_size=chunk, interpret=interpret, block_v=block_v, f32_dots=f32_dots)
    want = prefill_ref(*args, chunk_size=chunk)
    dots = f32_dots or C.default_f32_dots(dtype)
    tol = DOTS_RTOL.get(dots) if not (interpret and dots == "tf32") else None  # interpreted TF32 is IEEE
    assert_close(got[0], want[0], dtype, tol)
    assert_close(got[1][1:], want[1][1:], dtype, tol)
    np.testing.assert_array_equal(got[1][5], pool[5])
    assert not np.asarray(got[0][3]).any(), "padding row reads out zeros"


# T = 40 with chunk 16: rows of 40 (3 chunks, the last partial), 17 and 16 valid tokens; chunks
# of 32 and 64 run more levels of the intra-chunk solve's block doubling.
PREFILL_CASES = [(40, 16, 1), (33, 16, 3), (70, 32, 1), (70, 64, 2), (140, 64, 1)]


@pytest.mark.parametrize(("T", "chunk", "r"), PREFILL_CASES)
def test_prefill_interpret_float32(T, chunk, r):
    check_prefill(T + r, T=T, chunk=chunk, r=r, dtype=jnp.float32, interpret=True, **SMALL)


def test_prefill_interpret_bfloat16():
    check_prefill(5, T=40, chunk=16, r=2, dtype=jnp.bfloat16, interpret=True, **SMALL)


@pytest.mark.parametrize("chunk", [16, 64])
def test_prefill_interpret_extreme_gates(chunk):
    """g in {-50, ~0}, beta ~ 1: the explicit (I + A)^-1 must stay as exact as the reference's solve."""
    check_prefill(6, T=140, chunk=chunk, r=1, dtype=jnp.float32, interpret=True, gates="extreme", **SMALL)


@pytest.mark.parametrize("gates", ["normal", "extreme"])
@pytest.mark.parametrize("chunk", [16, 64])
def test_prefill_interpret_bf16_dots(chunk, gates):
    """f32_dots="bf16" rounds the float32 operands as compiled: within twice bfloat16's roundoff."""
    check_prefill(9, T=140, chunk=chunk, r=2, dtype=jnp.float32, interpret=True, gates=gates, f32_dots="bf16",
                  **SMALL)


@pytest.mark.parametrize("n", [16, 32, 64])
@pytest.mark.parametrize("keys", ["random", "repeated"])
def test_intra_chunk_solve_matches_a_dense_inverse(n, keys):
    """u = (I + A)^-1 (beta v), w = (I + A)^-1 (beta exp(G) k) against numpy's dense inverse in
    float64. Repeated keys with beta = 1 and no decay make A the all-ones strictly lower matrix,
    whose powers grow like binomials (the case that rules out a product-of-powers inverse)."""
    rng = np.random.default_rng(n)
    dk = dv = 16
    k = rng.standard_normal((n, dk))
    if keys == "repeated":
        k[:] = k[0]
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((n, dv))
    g = np.zeros(n) if keys == "repeated" else -np.log1p(np.exp(rng.standard_normal(n)))
    beta = np.ones(n) if keys == "repeated" else _sigmoid(rng.standard_normal(n))
    G = np.cumsum(g)
    a = np.tril(beta[:, None] * (k @ k.T) * np.exp(G[:, None] - G[None, :]), -1)
    t = np.linalg.inv(np.eye(n) + a)
    f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
    u, w = jax.jit(C._intra_chunk, static_argnums=4)(f32(k), f32(v), f32(G), f32(beta), C._dot)
    np.testing.assert_allclose(rel_rms(u, t @ (beta[:, None] * v)), 0, atol=1e-6)
    np.testing.assert_allclose(rel_rms(w, t @ ((beta * np.exp(G))[:, None] * k)), 0, atol=1e-6)


def test_prefill_default_block_v_widens_a_full_grid():
    assert C.default_block_v(8, 16, 128, sm_count=132) == 64  # 256 programs at 64 columns
    assert C.default_block_v(1, 16, 128, sm_count=132) == 32  # 32 programs at 64 columns leave SMs idle
    assert C.default_block_v(1, 16, 128, sm_count=16) == 64
    assert C.default_block_v(1, 4, 16) == 16


def test_prefill_refuses_an_unknown_dot_mode():
    rng = np.random.default_rng(0)
    inputs = gdn_inputs(rng, [8], 8, hv=2, dtype=jnp.float32, **SMALL)
    pool = jnp.zeros((2, 2, 16, 16), jnp.float32)
    with pytest.raises(ValueError, match="f32_dots='fp8'.*'ieee', 'tf32x3', 'tf32', 'bf16'"):
        gdn_prefill_pallas(*inputs, pool, i32(1), i32(1), jnp.asarray([False]), i32(8), interpret=True,
                           f32_dots="fp8")


# ----------------------------------------------------------------------------------------------
# Conv
# ----------------------------------------------------------------------------------------------


def check_conv(seed, *, mode, T, k_max, channels, dtype, interpret, block_c=256, block_t=None, extra=0,
               tail=True):
    """Rows: in-place row with a window offset, a fresh row writing another line (per-slot draft
    windows), a padding row (negative offset), a row whose offset is clamped into the line. `extra`
    channels past the lines' in x (a wider projection) must not be read: they hold NaN. With `tail` (the
    default) every line equals the reference's; without, each written line's rows past its new window
    keep what the line held (no step reads them), the rest equal the reference's."""
    rng = np.random.default_rng(seed)
    K = 4
    line_len = K - 1 + k_max
    x = jnp.asarray(rng.standard_normal((4, T, channels)), dtype)
    if extra:
        x = jnp.concatenate([x, jnp.full((4, T, extra), jnp.nan, dtype)], axis=-1)
    lines = jnp.asarray(rng.standard_normal((6, line_len, channels)), dtype)
    weight = jnp.asarray(rng.standard_normal((K, channels)), jnp.float32)
    args = (
        x, lines, weight,
        i32(1, 2, 0, 4),  # read_row
        i32(min(2, k_max), 0, -1, k_max + 5),  # offset
        i32(1, 3, 0, 4),  # write_row
        jnp.asarray([True, False, True, True]),  # has_state
        i32(T, max(T - 1, 0), 0, 1),  # num_valid
    )
    tiles = {} if block_t is None else {"block_t": block_t}  # None: the kernel's default
    y, new_lines = conv_pallas(*args, mode=mode, interpret=interpret, block_c=block_c, tail=tail, **tiles)
    y_ref, lines_ref = conv_ref(*args, mode=mode)
    assert y.dtype == y_ref.dtype == dtype and y.shape == y_ref.shape == (4, T, channels)
    assert_close(y, y_ref, dtype)
    if tail:
        np.testing.assert_array_equal(new_lines[1:], lines_ref[1:])
        return
    head = K - 2 + T if mode == "verify" else K - 1
    np.testing.assert_array_equal(new_lines[1:, :head], lines_ref[1:, :head])
    written = [1, 3, 4]  # write_row of the live rows (row 0 writes the null line 0)
    expect_tail = np.asarray(lines_ref[:, head:]).copy()
    expect_tail[written] = np.asarray(lines[written, head:])
    np.testing.assert_array_equal(new_lines[1:, head:], expect_tail[1:])


# (mode, T, k_max): decode, verify k = 3 and k = 15, a short and a multi-tile prefill.
CONV_CASES = [("verify", 1, 3), ("verify", 4, 3), ("verify", 16, 15), ("prefill", 2, 3), ("prefill", 37, 3)]


@pytest.mark.parametrize(("mode", "T", "k_max"), CONV_CASES)
def test_conv_interpret_float32(mode, T, k_max):
    check_conv(T, mode=mode, T=T, k_max=k_max, channels=16, dtype=jnp.float32, interpret=True, block_c=8, block_t=16)


@pytest.mark.parametrize(("mode", "T", "k_max"), [("verify", 1, 3), ("verify", 4, 15), ("prefill", 5, 3)])
def test_conv_without_the_line_tail(mode, T, k_max):
    check_conv(T + 1, mode=mode, T=T, k_max=k_max, channels=16, dtype=jnp.float32, interpret=True, block_c=8,
               tail=False)


@pytest.mark.parametrize("mode", ["verify", "prefill"])
def test_conv_interpret_bfloat16(mode):
    check_conv(7, mode=mode, T=4, k_max=3, channels=16, dtype=jnp.bfloat16, interpret=True, block_c=8)


# ----------------------------------------------------------------------------------------------
# Dispatch, and the Triton lowering itself (checked on CPU by lowering for CUDA)
# ----------------------------------------------------------------------------------------------


def test_api_dispatch():
    rng = np.random.default_rng(9)
    inputs = gdn_inputs(rng, [2, 1], 2, hk=2, hv=4, dk=16, dv=16, dtype=jnp.float32)
    pool = jnp.asarray(rng.standard_normal((5, 4, 16, 16)), jnp.float32)
    step = (i32(1, 3), i32([1, 2], [3, 4]), jnp.asarray([True, False]), i32(2, 1))
    want = api.gdn_verify(*inputs, pool, *step, implementation="xla")
    got = api.gdn_verify(*inputs, pool, *step, implementation="pallas", interpret=None if not ON_GPU else False)
    assert_close(got[0], want[0], jnp.float32)
    assert_close(got[1][1:], want[1][1:], jnp.float32)
    with pytest.raises(ValueError, match="implementation"):
        api.gdn_verify(*inputs, pool, *step, implementation="cuda")


@pytest.mark.parametrize("kernels", ["xla", "pallas"])
def test_ops_route_through_the_switch(kernels):
    """jaxspec.ops runs a pallas_call exactly when kernels="pallas" (tracing only; parity is above)."""
    B, T, hk, hv, d, C = 2, 3, 2, 4, 16, 2 * 2 * 16 + 4 * 16
    s = jax.ShapeDtypeStruct
    qkv = [s((B, T, hk, d), jnp.float32)] * 2 + [s((B, T, hv, d), jnp.float32)] + [s((B, T, hv), jnp.float32)] * 2
    pool, idx, flags = s((5, hv, d, d), jnp.float32), s((B,), jnp.int32), s((B,), jnp.bool_)
    calls = {
        "verify": (ops.gdn_verify, (*qkv, pool, idx, s((B, T), jnp.int32), flags, idx), {}),
        "prefill": (ops.gdn_prefill, (*qkv, pool, idx, idx, flags, idx), {}),
        "conv": (ops.conv_update, (s((B, T, C), jnp.float32), s((3, 6, C), jnp.float32), s((4, C), jnp.float32),
                                   idx, idx, idx, flags, idx), {"mode": "verify"}),
    }
    for fn, args, kw in calls.values():
        jaxpr = str(jax.make_jaxpr(lambda *a, fn=fn, kw=kw: fn(*a, **kw, kernels=kernels))(*args))
        assert ("pallas_call" in jaxpr) == (kernels == "pallas")


def _lower_for_cuda(fn, *shapes):
    """Lower fn for CUDA from a CPU host: runs every Pallas -> Triton lowering rule (shapes that
    are not powers of two, dot sizes, unsupported primitives) without a GPU; returns the HLO text."""
    traced = jax.jit(fn).trace(*(jax.ShapeDtypeStruct(s, d) for s, d in shapes))
    try:
        return traced.lower(lowering_platforms=("cuda",)).as_text()
    except TypeError as e:  # only the keyword itself may be missing; a TypeError in a lowering rule fails
        if "unexpected keyword argument 'lowering_platforms'" not in str(e):
            raise
        pytest.skip("this jax cannot lower for another platform")
    except RuntimeError as e:  # jax >= 0.11 asks the local GPU for its compute capability
        if "No supported GPU" not in str(e):
            raise
        pytest.skip("this jax needs a GPU (or an abstract one) to lower Triton kernels")


@pytest.mark.skipif(ON_GPU, reason="the GPU tests compile these kernels for real")
@pytest.mark.parametrize("r", [1, 3])
def test_kernels_lower_to_triton_for_qwen_shapes(r):
    B, T, hk, hv, d, S, bf, f32, i = 4, 8, 16, 16 * r, 128, 33, jnp.bfloat16, jnp.float32, jnp.int32
    qkv = [((B, T, hk, d), f32), ((B, T, hk, d), f32), ((B, T, hv, d), bf), ((B, T, hv), f32), ((B, T, hv), f32)]
    step = [((S, hv, d, d), f32), ((B,), i), ((B, T), i), ((B,), jnp.bool_), ((B,), i)]
    verify = _lower_for_cuda(gdn_verify_pallas, *qkv, *step)
    assert "triton" in verify and "fma.rn.f32" in verify  # the compiled update is one fused multiply-add
    step[2] = ((B,), i)
    qkv = [((B, 100, *s[2:]), dt) for s, dt in qkv]  # 2 chunks of 64, the second partial
    assert "triton" in _lower_for_cuda(gdn_prefill_pallas, *qkv, *step)
    C = 2 * hk * d + hv * d
    for mode, T in (("verify", 4), ("prefill", 100)):
        conv = [((B, T, C), bf), ((1 + B, 3 + 15, C), bf), ((4, C), bf), *[((B,), i)] * 3, ((B,), jnp.bool_), ((B,), i)]
        assert "triton" in _lower_for_cuda(lambda *a, m=mode: conv_update_pallas(*a, mode=m), *conv)


# ----------------------------------------------------------------------------------------------
# Compiled Triton on a GPU: the same checks on Qwen shapes
# ----------------------------------------------------------------------------------------------


@pytest.mark.skipif(not ON_GPU, reason="compiled Pallas (Triton) needs a GPU")
class TestPallasGPU:
    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
    @pytest.mark.parametrize("k", [0, 1, 3, 7, 15])
    @pytest.mark.parametrize("r", [1, 2, 3])
    def test_verify(self, dtype, k, r):
        check_verify(k * 10 + r, k=k, r=r, dtype=dtype, interpret=False, **QWEN)

    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
    @pytest.mark.parametrize("k", [1, 3, 7, 15])
    @pytest.mark.parametrize("form", FORMS)
    def test_verify_forms(self, dtype, k, form):
        check_verify(k * 10 + 7, k=k, r=2, dtype=dtype, interpret=False, form=form, **QWEN)

    @pytest.mark.parametrize("block_v", [16, 64, 128])
    def test_verify_block_v(self, block_v):
        check_verify(3, k=3, r=2, dtype=jnp.bfloat16, interpret=False, block_v=block_v, **QWEN)

    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
    @pytest.mark.parametrize("T", [1, 63, 64, 65, 300])
    @pytest.mark.parametrize("r", [1, 2, 3])
    def test_prefill(self, dtype, T, r):
        check_prefill(T + r, T=T, chunk=64, r=r, dtype=dtype, interpret=False, **QWEN)

    @pytest.mark.parametrize(("chunk", "block_v"), [(16, 16), (32, 64), (64, 128)])
    def test_prefill_blocks(self, chunk, block_v):  # three-pass TF32: float32's tolerance
        check_prefill(7, T=130, chunk=chunk, r=2, dtype=jnp.bfloat16, interpret=False, block_v=block_v,
                      f32_dots="tf32x3", **QWEN)

    @pytest.mark.parametrize("f32_dots", C.F32_DOTS)
    def test_prefill_extreme_gates(self, f32_dots):
        check_prefill(8, T=130, chunk=64, r=3, dtype=jnp.float32, interpret=False, gates="extreme", f32_dots=f32_dots,
                      **QWEN)

    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
    @pytest.mark.parametrize(("mode", "T", "k_max"), CONV_CASES + [("prefill", 300, 3)])
    @pytest.mark.parametrize("hv", [16, 48])
    def test_conv(self, dtype, mode, T, k_max, hv):
        check_conv(T, mode=mode, T=T, k_max=k_max, channels=2 * 16 * 128 + hv * 128, dtype=dtype, interpret=False)

    @pytest.mark.parametrize(("mode", "T", "k_max"), [("verify", 2, 15), ("verify", 8, 15), ("prefill", 37, 3)])
    def test_conv_without_the_line_tail(self, mode, T, k_max):
        check_conv(T, mode=mode, T=T, k_max=k_max, channels=2 * 16 * 128 + 16 * 128, dtype=jnp.bfloat16,
                   interpret=False, tail=False)
