"""The GDN's b / a projections: the reduction form taken by short inputs equals the matmul."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.models import layers


@pytest.mark.parametrize("rows", [1, 2, 16, layers.NARROW_ROWS, layers.NARROW_ROWS + 1])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_narrow_linear_equals_the_matmul(rows, dtype):
    kx, kw = jax.random.split(jax.random.PRNGKey(rows))
    x = jax.random.normal(kx, (1, rows, 96), jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, (96, 16), jnp.float32) / 10).astype(dtype)
    with jax.default_matmul_precision("highest"):  # a GPU's default float32 matmul is TF32 (10-bit mantissa)
        got = layers.narrow_linear(x, w)
    want = jnp.einsum("rti,io->rto", x.astype(jnp.float32), w.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)
    assert got.shape == (1, rows, 16) and got.dtype == dtype
    tol = 1e-5 if dtype == jnp.float32 else 1e-2  # bfloat16: one rounding of the output
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=tol, atol=tol)


def test_narrow_linear_takes_the_reduction_form_only_for_short_narrow_inputs():
    def has_dot(x, w):
        return "dot_general" in str(jax.make_jaxpr(layers.narrow_linear)(x, w))

    x = jnp.ones((2, 1, 2048), jnp.bfloat16)
    assert not has_dot(x, jnp.ones((2048, 16), jnp.bfloat16))  # decode: b / a of 16 value heads
    assert has_dot(jnp.ones((8, 64, 2048), jnp.bfloat16), jnp.ones((2048, 16), jnp.bfloat16))  # prefill rows
    assert has_dot(x, jnp.ones((2048, layers.NARROW_COLUMNS + 1), jnp.bfloat16))  # wide outputs
