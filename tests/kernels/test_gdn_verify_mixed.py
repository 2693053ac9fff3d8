"""The GDN verify kernel with the layer's glue inside (`gdn_verify_mixed_pallas`) against
`reference.gdn_verify_mixed`, and the conv reading the leading channels of a wider projection.

Inputs are what the layer hands over: the conv output (channels grouped per key head), the raw a / b
projections, A_log and dt_bias. Tolerances as test_gdn_pallas.py (by the compared output's dtype:
o and the pools are float32).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gated_delta import api
from pallas_kernels.gated_delta import reference as R
from pallas_kernels.gated_delta.recurrent import FORMS, gdn_verify_mixed_pallas, gdn_verify_pallas, mixed_fits
from tests.kernels.test_gdn_pallas import (
    ON_GPU,
    QWEN,
    SMALL,
    _lower_for_cuda,
    assert_close,
    check_conv,
    i32,
    verify_rounds,
)

mixed_ref = jax.jit(R.gdn_verify_mixed)
mixed_pallas = jax.jit(gdn_verify_mixed_pallas, static_argnames=("interpret", "block_v", "form"))
verify_pallas = jax.jit(gdn_verify_pallas, static_argnames=("interpret", "block_v", "form"))


def mixed_inputs(rng, num_valid, T, *, hk, r, dk, dv, dtype):
    """mixed [B, T, hk (2 dk + r dv)], a, b [B, T, hv] in dtype; A_log, dt_bias [hv] float32. Tokens
    t >= num_valid[b] hold large values that only masking keeps out."""
    B, hv = len(num_valid), hk * r
    mixed = rng.standard_normal((B, T, hk * (2 * dk + r * dv)))
    a, b = rng.standard_normal((B, T, hv)) * 2, rng.standard_normal((B, T, hv)) * 2
    for row, n in enumerate(num_valid):
        mixed[row, n:], a[row, n:], b[row, n:] = 1e3, 50.0, -50.0
    a_log = np.log(rng.uniform(1.0, 16.0, hv))
    dt_bias = rng.standard_normal(hv)
    cast = lambda x, dt=dtype: jnp.asarray(np.asarray(x, np.float32), dt)  # noqa: E731
    return cast(mixed), cast(a), cast(b), cast(a_log, jnp.float32), cast(dt_bias, jnp.float32)


def check_mixed(seed, *, k, r, dtype, interpret, block_v=None, form=None, hk, dk, dv):
    """test_gdn_pallas.verify_rounds of the fused kernel against the reference, and against the
    unfused kernel run on the reference's inputs (the glue moved, the recurrence did not)."""
    rng = np.random.default_rng(seed)
    T = 1 + k

    def both(inputs, pool, step):
        got = mixed_pallas(*inputs, pool, *step, interpret=interpret, block_v=block_v, form=form)
        want = mixed_ref(*inputs, pool, *step)
        assert_close(got[0], want[0], dtype)
        assert_close(got[1][1:], want[1][1:], dtype)
        np.testing.assert_array_equal(got[1][0], pool[0], "the padding row stored into the null slot")
        assert not np.asarray(got[0][3]).any(), "padding row reads out zeros"
        unfused = verify_pallas(*R.gdn_inputs(*inputs, dk=dk, dv=dv), pool, *step, interpret=interpret,
                                block_v=block_v)
        assert_close(got[0], unfused[0], dtype)
        return want[1]

    verify_rounds(rng, T, hk * r, dk, dv, lambda nv: mixed_inputs(rng, nv, T, hk=hk, r=r, dk=dk, dv=dv, dtype=dtype),
                  both)


# (k, r): decode, every GVA ratio, the longest span.
MIXED_CASES = [(0, 1), (1, 2), (3, 3), (15, 2)]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize(("k", "r"), MIXED_CASES)
def test_mixed_interpret_float32(k, r, form):
    check_mixed(k, k=k, r=r, dtype=jnp.float32, interpret=True, block_v=8, form=form, **SMALL)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize(("k", "r"), [(3, 2), (7, 3)])
def test_mixed_interpret_bfloat16(k, r, form):
    check_mixed(100 + k, k=k, r=r, dtype=jnp.bfloat16, interpret=True, form=form, **SMALL)


def test_mixed_fits():
    assert mixed_fits(128, 128, 32) and mixed_fits(128, 128, 64) and mixed_fits(16, 16, 16)
    assert not mixed_fits(24, 32, 16)  # dk not a power of two
    assert not mixed_fits(16, 64, 64)  # a value head would start mid-block (2 dk = 32 columns)
    assert not mixed_fits(128, 96, 64)  # block does not divide dv


@pytest.mark.parametrize(("dk", "dv"), [(24, 16), (16, 48)])
def test_api_runs_any_head_size(dk, dv):
    """Heads the in-place kernel cannot tile (dk 24) fall back to the glue in XLA and the padded
    kernel; dv 48 tiles in place. Both match the reference."""
    rng = np.random.default_rng(dk + dv)
    inputs = mixed_inputs(rng, [3, 2], 3, hk=2, r=2, dk=dk, dv=dv, dtype=jnp.float32)
    pool = jnp.asarray(rng.standard_normal((7, 4, dk, dv)), jnp.float32)
    step = (i32(1, 4), i32([1, 2, 3], [4, 5, 6]), jnp.asarray([True, False]), i32(3, 2))
    want = api.gdn_verify_mixed(*inputs, pool, *step, implementation="xla")
    got = api.gdn_verify_mixed(*inputs, pool, *step, implementation="pallas", interpret=None if not ON_GPU else False)
    assert_close(got[0], want[0], jnp.float32)
    assert_close(got[1][1:], want[1][1:], jnp.float32)


def test_bad_shapes_are_refused():
    rng = np.random.default_rng(1)
    mixed, a, b, a_log, dt_bias = mixed_inputs(rng, [2], 2, hk=2, r=2, dk=16, dv=16, dtype=jnp.float32)
    pool = jnp.zeros((3, 4, 16, 16), jnp.float32)
    step = (i32(1), i32([1, 2]), jnp.asarray([True]), i32(2))
    with pytest.raises(ValueError, match=r"a_log shape \(3,\) must be \(4,\)"):
        gdn_verify_mixed_pallas(mixed, a, b, a_log[:3], dt_bias, pool, *step, interpret=True)
    with pytest.raises(ValueError, match="channels=95 is not HK"):
        gdn_verify_mixed_pallas(mixed[..., :95], a, b, a_log, dt_bias, pool, *step, interpret=True)
    with pytest.raises(ValueError, match="block_v=32"):
        gdn_verify_mixed_pallas(mixed, a, b, a_log, dt_bias, pool, *step, interpret=True, block_v=32)


def packed_gates(a, b, *, before: int, between: int, after: int):
    """b and a inside one wider array, as a packed projection output holds them ([.. | b | .. | a | ..]),
    the other channels NaN (a kernel reading them would fail): (proj, a_at, b_at)."""
    fill = lambda n: jnp.full(a.shape[:2] + (n,), jnp.nan, a.dtype)  # noqa: E731
    proj = jnp.concatenate([fill(before), b, fill(between), a, fill(after)], axis=-1)
    hv = a.shape[-1]
    return proj, before + hv + between, before


@pytest.mark.parametrize(("k", "r", "dtype"), [(0, 2, jnp.float32), (3, 3, jnp.bfloat16)])
def test_gates_read_in_place_from_a_packed_projection(k, r, dtype):
    """a / b at channel offsets of one array (jaxspec/models/packing.py's layer output) give what the
    separate arrays give, in the kernel and in the XLA path."""
    rng = np.random.default_rng(7 + k)
    T, hv = 1 + k, 2 * r
    mixed, a, b, a_log, dt_bias = mixed_inputs(rng, [T, 1], T, hk=2, r=r, dk=16, dv=16, dtype=dtype)
    proj, a_at, b_at = packed_gates(a, b, before=40, between=3, after=5)
    pool = jnp.asarray(rng.standard_normal((4 + T, hv, 16, 16)), jnp.float32)  # row 0 writes slots 3 .. 2 + T
    step = (i32(1, 2), i32(list(range(3, 3 + T)), [3 + T] + [0] * k), jnp.asarray([True, False]), i32(T, 1))
    want = mixed_pallas(mixed, a, b, a_log, dt_bias, pool, *step, interpret=True)
    got = jax.jit(gdn_verify_mixed_pallas, static_argnames=("interpret", "a_at", "b_at"))(
        mixed, proj, proj, a_log, dt_bias, pool, *step, a_at=a_at, b_at=b_at, interpret=True)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    xla = api.gdn_verify_mixed(mixed, proj, proj, a_log, dt_bias, pool, *step, a_at=a_at, b_at=b_at)
    ref = mixed_ref(mixed, a, b, a_log, dt_bias, pool, *step)
    np.testing.assert_array_equal(np.asarray(xla[0]), np.asarray(ref[0]))


def test_gate_offsets_outside_the_array_are_refused():
    rng = np.random.default_rng(2)
    mixed, a, b, a_log, dt_bias = mixed_inputs(rng, [2], 2, hk=2, r=2, dk=16, dv=16, dtype=jnp.float32)
    proj, a_at, b_at = packed_gates(a, b, before=4, between=0, after=0)  # 12 channels: b at 4, a at 8
    pool = jnp.zeros((3, 4, 16, 16), jnp.float32)
    step = (i32(1), i32([1, 2]), jnp.asarray([True]), i32(2))
    for implementation in ("pallas", "xla"):
        with pytest.raises(ValueError, match=r"a shape \(1, 2, 12\) with a_at=9 must be .* holding 4 channels"):
            api.gdn_verify_mixed(mixed, proj, proj, a_log, dt_bias, pool, *step, a_at=9, b_at=b_at,
                                 implementation=implementation, interpret=True)
        with pytest.raises(ValueError, match="b_at=-1"):
            api.gdn_verify_mixed(mixed, proj, proj, a_log, dt_bias, pool, *step, a_at=a_at, b_at=-1,
                                 implementation=implementation, interpret=True)
    with pytest.raises(ValueError, match=r"b shape \(1, 3, 4\)"):  # tokens differ from mixed's
        gdn_verify_mixed_pallas(mixed, a, jnp.zeros((1, 3, 4)), a_log, dt_bias, pool, *step, interpret=True)


@pytest.mark.parametrize("mode", ["verify", "prefill"])
def test_conv_reads_leading_channels(mode):
    """x wider than the lines (the conv input merged with the z projection): the kernel and the
    reference read only the lines' channels."""
    check_conv(3, mode=mode, T=4, k_max=3, channels=16, extra=16, dtype=jnp.float32, interpret=True, block_c=8)


@pytest.mark.skipif(ON_GPU, reason="the GPU tests compile the kernel for real")
@pytest.mark.parametrize("r", [1, 3])
@pytest.mark.parametrize("form", FORMS)
def test_mixed_lowers_to_triton_for_qwen_shapes(r, form):
    B, T, hk, d, S, bf, f32, i = 4, 8, 16, 128, 33, jnp.bfloat16, jnp.float32, jnp.int32
    hv = hk * r
    shapes = [((B, T, hk * (2 * d + r * d)), bf), ((B, T, hv), bf), ((B, T, hv), bf), ((hv,), f32), ((hv,), f32),
              ((S, hv, d, d), f32), ((B,), i), ((B, T), i), ((B,), jnp.bool_), ((B,), i)]
    lowered = _lower_for_cuda(functools.partial(gdn_verify_mixed_pallas, form=form), *shapes)
    assert "triton" in lowered
    assert ("fma.rn.f32" in lowered) == (form != "chunk")  # the stepped update is one fused multiply-add
    packed = [((B, T, 5000), bf)] * 2  # a / b in place in one projection output (packing.py)
    lower = lambda *args: gdn_verify_mixed_pallas(*args, a_at=4000 + hv, b_at=4000)  # noqa: E731
    assert "triton" in _lower_for_cuda(lower, shapes[0], *packed, *shapes[3:])


@pytest.mark.skipif(not ON_GPU, reason="compiled Pallas (Triton) needs a GPU")
class TestMixedGPU:
    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
    @pytest.mark.parametrize("k", [0, 1, 3, 7, 15])
    @pytest.mark.parametrize("r", [1, 2, 3])
    def test_mixed(self, dtype, k, r):
        check_mixed(k * 10 + r, k=k, r=r, dtype=dtype, interpret=False, **QWEN)

    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
    @pytest.mark.parametrize("k", [1, 3, 7, 15])
    @pytest.mark.parametrize("form", FORMS)
    def test_mixed_forms(self, dtype, k, form):
        check_mixed(k * 10 + 3, k=k, r=3, dtype=dtype, interpret=False, form=form, **QWEN)

    @pytest.mark.parametrize("k", [0, 1, 7])
    def test_gates_in_place(self, k):
        rng = np.random.default_rng(50 + k)
        T, hk, r, d = 1 + k, 16, 1, 128
        mixed, a, b, a_log, dt_bias = mixed_inputs(rng, [T, 1], T, hk=hk, r=r, dk=d, dv=d, dtype=jnp.bfloat16)
        proj, a_at, b_at = packed_gates(a, b, before=8192, between=0, after=0)
        pool = jnp.asarray(rng.standard_normal((4 + T, hk * r, d, d)), jnp.float32)  # row 0 writes 3 .. 2 + T
        step = (i32(1, 2), i32(list(range(3, 3 + T)), [3 + T] + [0] * k), jnp.asarray([True, False]), i32(T, 1))
        want = mixed_ref(mixed, a, b, a_log, dt_bias, pool, *step)
        got = jax.jit(gdn_verify_mixed_pallas, static_argnames=("a_at", "b_at"))(
            mixed, proj, proj, a_log, dt_bias, pool, *step, a_at=a_at, b_at=b_at)
        assert_close(got[0], want[0], jnp.bfloat16)
        assert_close(got[1][1:], want[1][1:], jnp.bfloat16)

    @pytest.mark.parametrize("block_v", [16, 32, 64])
    def test_mixed_block_v(self, block_v):
        check_mixed(3, k=3, r=2, dtype=jnp.bfloat16, interpret=False, block_v=block_v, **QWEN)

    def test_conv_reads_leading_channels(self):
        check_conv(3, mode="verify", T=4, k_max=3, channels=2 * 16 * 128 + 16 * 128, extra=2048, dtype=jnp.bfloat16,
                   interpret=False)
