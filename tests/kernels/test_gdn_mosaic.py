"""Mosaic GPU GDN verify kernel (pallas_kernels/gated_delta/recurrent_mosaic.py) vs `reference.gdn_verify`.

Three levels, so every machine checks what it can:
- everywhere: argument checks, and lowering to the Mosaic GPU custom call for CUDA (the whole
  Pallas -> Mosaic GPU lowering, layouts included; no ptxas, nothing runs);
- jax >= 0.11 (`plgpu.InterpretGPUParams`): parity in the Mosaic GPU interpreter on small heads
  (dk = dv = 64); jax 0.10's interpreter cannot run `plgpu.load`, so these skip there;
- on a GPU (sm_90+): parity on Qwen heads (dk = dv = 128, HK = 16, HV = 16 / 48).
Outputs are compared by relative RMS, < 1e-5: o and the state pool are float32 whatever the input
dtype, and the kernel computes in float32 (no tensor cores), as the reference does; pools on
every slot but the null slot 0 (padding rows all write there, in an unspecified order).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.gated_delta import api
from pallas_kernels.gated_delta import reference as R
from pallas_kernels.gated_delta.recurrent_mosaic import gdn_verify_mosaic

ON_GPU = jax.default_backend() == "gpu"
GPU_INTERPRETER = getattr(plgpu, "InterpretGPUParams", None)  # jax >= 0.11
RTOL = 1e-5  # o and the pool are float32 for float32 and bfloat16 inputs alike

verify_ref = jax.jit(R.gdn_verify)


def rel_rms(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b**2)))


def assert_close(got, want, dtype):
    """rel_rms(got, want) < RTOL; both float32 (dtype, the inputs' dtype, does not loosen it)."""
    assert got.dtype == want.dtype == jnp.float32, (got.dtype, want.dtype)
    got = np.asarray(got, np.float64)
    assert got.shape == np.shape(want) and np.isfinite(got).all()
    err = rel_rms(got, want)
    assert err < RTOL, f"relative RMS error {err:.3g} >= {RTOL:g} ({np.dtype(dtype).name} inputs)"


def gdn_inputs(rng, num_valid, T, *, hk, hv, dk, dv, dtype):
    """q, k [B, T, hk, dk] (normalised, q scaled), v [B, T, hv, dv], beta [B, T, hv] in dtype, g
    [B, T, hv] float32; tokens t >= num_valid[b] hold garbage (NaN in q) that only masking removes."""
    B = len(num_valid)
    q = np.array(R.l2norm(rng.standard_normal((B, T, hk, dk)))) * dk**-0.5
    k = np.array(R.l2norm(rng.standard_normal((B, T, hk, dk))))
    v = rng.standard_normal((B, T, hv, dv))
    g = np.log(1 / (1 + np.exp(-rng.standard_normal((B, T, hv)))))
    beta = 1 / (1 + np.exp(-rng.standard_normal((B, T, hv))))
    for b, n in enumerate(num_valid):
        q[b, n:], k[b, n:], v[b, n:], g[b, n:], beta[b, n:] = np.nan, -10.0, 1e3, 5.0, 3.0
    cast = lambda x: jnp.asarray(np.asarray(x, np.float32), dtype)  # noqa: E731
    return cast(q), cast(k), cast(v), jnp.asarray(g, jnp.float32), cast(beta)


def i32(*xs):
    return jnp.asarray(xs, jnp.int32)


def check_verify(seed, *, T, r, dtype, run, hk, dk, dv):
    """Rows: request A (all T tokens valid), B (T - 2 valid), C (fresh, has_state False), padding.
    Round 1 reads slots holding junk states; round 2 runs for acceptance counts a = 1 and T, each
    request reading its own snapshot base + min(a, num_valid) - 1 from round 1."""
    rng = np.random.default_rng(seed)
    hv = hk * r
    bases = [1, 1 + T, 1 + 2 * T]  # request i owns state slots bases[i] .. bases[i] + T - 1
    num_valid = [T, max(1, T - 2), T, 0]
    pool = jnp.asarray(rng.standard_normal((1 + 3 * T, hv, dk, dv)) * 0.5, jnp.float32)
    write = jnp.asarray([[b + t for t in range(T)] for b in bases] + [[0] * T], jnp.int32)
    heads = {"hk": hk, "hv": hv, "dk": dk, "dv": dv, "dtype": dtype}

    def both(inputs, read, has):
        args = (*inputs, pool, read, write, has, i32(*num_valid))
        got, want = run(*args), verify_ref(*args)
        assert_close(got[0], want[0], dtype)
        assert_close(got[1][1:], want[1][1:], dtype)
        assert not np.asarray(got[0][3]).any(), "padding row reads out zeros"
        return want[1]

    has_state = jnp.asarray([True, True, False, False])
    pool = both(gdn_inputs(rng, num_valid, T, **heads), i32(bases[0] + T - 1, bases[1], bases[2], 0), has_state)
    inputs = gdn_inputs(rng, num_valid, T, **heads)
    for a in sorted({1, T}):
        read = i32(*(base + min(a, n) - 1 for base, n in zip(bases, num_valid[:3], strict=True)), 0)
        both(inputs, read, jnp.asarray([True, True, True, False]))


def _abstract_args(B, T, hk, hv, dk, dv, dtype=jnp.float32):
    sds = jax.ShapeDtypeStruct
    f32 = jnp.float32
    return (sds((B, T, hk, dk), dtype), sds((B, T, hk, dk), dtype), sds((B, T, hv, dv), dtype), sds((B, T, hv), f32),
            sds((B, T, hv), dtype), sds((1 + B * T, hv, dk, dv), f32), sds((B,), jnp.int32),
            sds((B, T), jnp.int32), sds((B,), jnp.bool_), sds((B,), jnp.int32))


@pytest.mark.parametrize(("hk", "hv", "dk", "dv", "block_v"), [(2, 4, 64, 48, 32), (2, 3, 64, 64, 32),
                                                                 (2, 4, 32, 64, 32), (2, 4, 64, 64, 16)])
def test_rejects_unsupported_shapes(hk, hv, dk, dv, block_v):
    q, k, v, g, beta, pool, *idx = (jnp.zeros(a.shape, a.dtype) for a in _abstract_args(1, 1, hk, hv, dk, dv))
    with pytest.raises(ValueError):
        gdn_verify_mosaic(q, k, v, g, beta, pool, *idx, block_v=block_v)


@pytest.mark.skipif(ON_GPU, reason="checks the refusal off the GPU")
def test_api_refuses_mosaic_without_a_gpu():
    args = [jnp.zeros(a.shape, a.dtype) for a in _abstract_args(1, 1, 2, 4, 64, 64)]
    with pytest.raises(ValueError, match="implementation='mosaic'.*Valid on CPU: 'xla', 'pallas'"):
        api.gdn_verify(*args, implementation="mosaic")
    with pytest.raises(ValueError, match="gdn_verify also takes 'mosaic'"):
        api.gdn_prefill(*args, implementation="mosaic")


@pytest.mark.parametrize(("T", "hv", "dtype"), [(1, 16, jnp.float32), (4, 48, jnp.bfloat16), (16, 48, jnp.float32)])
def test_lowers_for_cuda(T, hv, dtype):
    """The Pallas -> Mosaic GPU lowering runs on any host; the pool is donated into an alias."""
    fn = jax.jit(gdn_verify_mosaic, donate_argnums=5)
    text = fn.trace(*_abstract_args(2, T, 16, hv, 128, 128, dtype)).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text and "output_operand_alias" in text


@pytest.mark.skipif(GPU_INTERPRETER is None, reason="jax < 0.11: the Mosaic GPU interpreter cannot run plgpu.load")
@pytest.mark.parametrize(("T", "r", "dtype"), [(1, 1, jnp.float32), (4, 2, jnp.float32), (3, 3, jnp.bfloat16)])
def test_verify_interpret(T, r, dtype):
    run = jax.jit(functools.partial(gdn_verify_mosaic, interpret=GPU_INTERPRETER()))
    check_verify(T, T=T, r=r, dtype=dtype, run=run, hk=2, dk=64, dv=64)


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU (sm_90+)")
class TestGPU:
    run = staticmethod(jax.jit(gdn_verify_mosaic, static_argnames="block_v"))

    def test_through_the_api(self):
        run = jax.jit(functools.partial(api.gdn_verify, implementation="mosaic"))
        check_verify(3, T=4, r=3, dtype=jnp.float32, run=run, hk=16, dk=128, dv=128)

    @pytest.mark.parametrize(("T", "r"), [(1, 1), (4, 3), (8, 1), (16, 3)])
    def test_verify_float32(self, T, r):
        check_verify(T, T=T, r=r, dtype=jnp.float32, run=self.run, hk=16, dk=128, dv=128)

    @pytest.mark.parametrize(("T", "r"), [(4, 1), (8, 3)])
    def test_verify_bfloat16(self, T, r):
        check_verify(100 + T, T=T, r=r, dtype=jnp.bfloat16, run=self.run, hk=16, dk=128, dv=128)

    def test_verify_block_v_64(self):
        check_verify(7, T=4, r=3, dtype=jnp.float32, run=functools.partial(self.run, block_v=64),
                     hk=16, dk=128, dv=128)
