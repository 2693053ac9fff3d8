"""Head dims that are not powers of two (nor >= 16) through the Pallas entry points, against the
references: attention pads D on load (q in the wrapper), GDN pads dk / dv of q, k, v and a small
gathered copy of the touched states (pallas_kernels/gated_delta/api.py `_padded`). Interpret mode
on CPU; the GPU class (`python -m pytest tests/kernels -k GPU`) compiles the same checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention import api as attention_api
from pallas_kernels.gated_delta import api as gdn_api
from pallas_kernels.gated_delta import reference as gdn_ref
from pallas_kernels.gated_delta.chunk import default_f32_dots
from tests.kernels.test_attention import make_case, rel_rms, written_step
from tests.kernels.test_gdn_pallas import DOTS_RTOL, assert_close, gdn_inputs, i32

ON_GPU = jax.default_backend() == "gpu"
ATTN_RTOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


def check_attention(seed, *, head_dim, dtype, splits, span=3, group=2, interpret=None):
    """Rows of 5+T, 40+T and 21+T keys (page 16) plus a padding row; output vs the reference."""
    args, _ = make_case(seed, span=span, n_heads=2 * group, n_kv=2, head_dim=head_dim, page_size=16,
                        starts=(5, 40, 21), valids=(span, span, 1), dtype=dtype)
    step = written_step(args)
    want = attention_api.paged_attention(*step, scale=head_dim**-0.5, implementation="xla")
    got = attention_api.paged_attention(*step, scale=head_dim**-0.5, implementation="pallas", interpret=interpret,
                                        num_splits=splits)
    assert got.shape == want.shape and got.dtype == want.dtype
    got, want = np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32))
    assert np.isfinite(got).all() and not got[-1].any(), "padding row: finite zeros"
    assert rel_rms(got, want) < ATTN_RTOL[dtype]


@pytest.mark.parametrize("head_dim", [24, 48])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_attention_interpret(head_dim, dtype):
    check_attention(head_dim, head_dim=head_dim, dtype=dtype, splits=2)


def check_verify(seed, *, dk, dv, dtype, T=3, hk=2, r=2, interpret=None):
    """Rows: A reads one of its own write slots (read before write), B partly valid, C fresh
    (has_state False), padding; slot 1 + 3T is never written and must stay as it was."""
    rng = np.random.default_rng(seed)
    hv, num_valid = hk * r, [T, T - 1, T, 0]
    inputs = gdn_inputs(rng, num_valid, T, hk=hk, hv=hv, dk=dk, dv=dv, dtype=dtype)
    pool = jnp.asarray(rng.standard_normal((2 + 3 * T, hv, dk, dv)) * 0.5, jnp.float32)
    write = jnp.asarray([[1 + b * T + t for t in range(T)] for b in range(3)] + [[0] * T], jnp.int32)
    args = (*inputs, pool, i32(1 + T - 1, 1 + T, 0, 0), write, jnp.asarray([True, True, False, False]),
            i32(*num_valid))
    got = gdn_api.gdn_verify(*args, implementation="pallas", interpret=interpret)
    want = gdn_ref.gdn_verify(*args)
    assert_close(got[0], want[0], dtype)
    assert_close(got[1][1:], want[1][1:], dtype)
    np.testing.assert_array_equal(got[1][-1], pool[-1])
    assert not np.asarray(got[0][3]).any(), "padding row reads out zeros"


def check_prefill(seed, *, dk, dv, dtype, T=20, hk=2, r=2, interpret=None):
    """Rows: fresh (slot 1), a continuation (reads 2, writes 3), one reading and writing slot 4,
    padding; slot 5 is never written."""
    rng = np.random.default_rng(seed)
    hv, num_valid = hk * r, [T, 17, 5, 0]
    inputs = gdn_inputs(rng, num_valid, T, hk=hk, hv=hv, dk=dk, dv=dv, dtype=dtype)
    pool = jnp.asarray(rng.standard_normal((6, hv, dk, dv)) * 0.5, jnp.float32)
    args = (*inputs, pool, i32(1, 2, 4, 0), i32(1, 3, 4, 0), jnp.asarray([False, True, True, True]), i32(*num_valid))
    got = gdn_api.gdn_prefill(*args, implementation="pallas", interpret=interpret)
    want = gdn_ref.gdn_prefill(*args, chunk_size=16)
    tol = DOTS_RTOL.get(default_f32_dots(dtype)) if interpret is False else None  # compiled: the default dots round
    assert_close(got[0], want[0], dtype, tol)
    assert_close(got[1][1:], want[1][1:], dtype, tol)
    np.testing.assert_array_equal(got[1][5], pool[5])
    assert not np.asarray(got[0][3]).any(), "padding row reads out zeros"


GDN_DIMS = [(24, 48), (8, 12)]  # (dk, dv); 8 and 12 are below the dots' 16


@pytest.mark.parametrize(("dk", "dv"), GDN_DIMS, ids=lambda d: str(d))
def test_gdn_verify_interpret(dk, dv):
    check_verify(dk + dv, dk=dk, dv=dv, dtype=jnp.float32)


@pytest.mark.parametrize(("dk", "dv"), GDN_DIMS, ids=lambda d: str(d))
def test_gdn_prefill_interpret(dk, dv):
    check_prefill(dk + dv, dk=dk, dv=dv, dtype=jnp.float32)


def test_gdn_bfloat16_interpret():
    check_verify(3, dk=24, dv=48, dtype=jnp.bfloat16)
    check_prefill(4, dk=24, dv=48, dtype=jnp.bfloat16)


def test_gdn_power_of_two_dims_take_the_kernel_directly(monkeypatch):
    """No padding copy when the dims already fit: the kernel gets the caller's pool."""
    seen = {}

    def spy(q, k, v, g, beta, pool, *rest, **kw):
        seen["pool"] = pool
        return jnp.zeros(v.shape, jnp.float32), pool

    monkeypatch.setattr(gdn_api, "gdn_verify_pallas", spy)
    rng = np.random.default_rng(0)
    inputs = gdn_inputs(rng, [1], 1, hk=1, hv=1, dk=16, dv=32, dtype=jnp.float32)
    pool = jnp.zeros((2, 1, 16, 32), jnp.float32)
    gdn_api.gdn_verify(*inputs, pool, i32(1), i32(1)[None], jnp.asarray([True]), i32(1), implementation="pallas")
    assert seen["pool"] is pool


@pytest.mark.skipif(not ON_GPU, reason="compiled Pallas (Triton) needs a GPU")
class TestOddHeadDimsGPU:
    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
    @pytest.mark.parametrize("head_dim", [24, 48, 96, 160])
    @pytest.mark.parametrize("splits", [None, 1])
    def test_attention(self, dtype, head_dim, splits):
        check_attention(5, head_dim=head_dim, dtype=dtype, splits=splits, span=4, group=4, interpret=False)

    @pytest.mark.parametrize(("dk", "dv"), [*GDN_DIMS, (48, 24), (96, 160)], ids=lambda d: str(d))
    def test_gdn(self, dk, dv):
        check_verify(6, dk=dk, dv=dv, dtype=jnp.bfloat16, interpret=False)
        check_prefill(7, dk=dk, dv=dv, dtype=jnp.bfloat16, interpret=False)
