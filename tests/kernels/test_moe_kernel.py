"""Grouped expert matmuls (pallas_kernels/moe): the Pallas kernel and the ragged_dot reference
against a float64 loop over rows, with empty groups, a crowded group (several row blocks), the
decode case (one row per chosen expert) and K / N that are not powers of two. Interpret mode on CPU;
the GPU class (`python -m pytest tests/kernels -k GPU`) runs the published MoE shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.moe import api
from pallas_kernels.moe.kernel import TARGET_PROGRAMS, block_sizes, group_slots

ON_GPU = jax.default_backend() == "gpu"
# float32 as in tests/kernels/test_attention.py: on the H200, the published shapes (K = 2048) come out at
# 1.2e-6 (the CPU interpreter at 1.4e-7), the error of Triton's float32 dots summed over 2048 products.
RTOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


def case(seed, *, rows, groups, k_dim, n_dim, sizes=None):
    """x [rows, K], w_gate / w_up [E, K, N], group sizes [E] (random routing unless given), float64."""
    rng = np.random.default_rng(seed)
    if sizes is None:
        sizes = np.bincount(rng.integers(0, groups, rows), minlength=groups)
    sizes = np.asarray(sizes, np.int32)
    assert sizes.sum() == rows
    x = rng.standard_normal((rows, k_dim))
    w_gate, w_up = (rng.standard_normal((groups, k_dim, n_dim)) / k_dim**0.5 for _ in range(2))
    return x, w_gate, w_up, sizes


def loop(x, w, sizes, w_up=None) -> np.ndarray:
    """Row by row with its group's weights, in float64: x w, or silu(x w) * (x w_up)."""
    group = np.repeat(np.arange(len(sizes)), sizes)
    out = []
    for row, e in zip(x, group, strict=True):
        a = row @ w[e]
        out.append(a if w_up is None else a / (1 + np.exp(-a)) * (row @ w_up[e]))
    return np.stack(out)


def rel_rms(got, want) -> float:
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    return float(np.sqrt(np.mean((got - want) ** 2) / np.mean(want**2)))


def check(seed, *, dtype, implementation="pallas", interpret=None, **shape):
    x, w_gate, w_up, sizes = case(seed, **shape)
    # The oracle sees the inputs as rounded to dtype, so only the computation's rounding counts.
    x, w_gate, w_up = (np.asarray(jnp.asarray(a, dtype).astype(jnp.float32), np.float64) for a in (x, w_gate, w_up))
    args = [jnp.asarray(a, dtype) for a in (x, w_gate, w_up)] + [jnp.asarray(sizes)]
    glu = api.grouped_glu(*args, implementation=implementation, interpret=interpret)
    mm = api.grouped_matmul(args[0], args[1], args[3], implementation=implementation, interpret=interpret)
    for got, want in ((glu, loop(x, w_gate, sizes, w_up)), (mm, loop(x, w_gate, sizes))):
        assert got.shape == want.shape and got.dtype == dtype
        assert rel_rms(got, want) < RTOL[dtype], rel_rms(got, want)


SHAPES = {
    "decode": dict(rows=6, groups=16, k_dim=32, n_dim=64),  # one row per chosen expert, most experts empty
    "crowded": dict(rows=40, groups=4, k_dim=32, n_dim=16, sizes=[0, 37, 0, 3]),  # 37 rows: 3 blocks of 16
    "odd_dims": dict(rows=12, groups=8, k_dim=24, n_dim=48),  # K and N tails masked
    "more_rows_than_groups": dict(rows=80, groups=6, k_dim=64, n_dim=40),
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("name", SHAPES)
def test_pallas_equals_the_row_loop(name, dtype):
    check(1, dtype=dtype, **SHAPES[name])


@pytest.mark.parametrize("name", ["decode", "crowded"])
def test_reference_equals_the_row_loop(name):
    check(2, dtype=jnp.float32, implementation="xla", **SHAPES[name])


def test_slots_list_the_groups_that_own_rows():
    expert, start, count = group_slots(jnp.asarray([0, 3, 0, 0, 2, 1], jnp.int32), n_slots=5)
    assert expert.tolist()[:3] == [1, 4, 5] and start.tolist()[:3] == [0, 3, 5]
    assert count.tolist() == [3, 2, 1, 0, 0]


def test_block_sizes_spread_a_decode_step_over_the_gpu():
    # Qwen3.5-35B-A3B decode: 8 pairs, gate/up N = 512, down N = 2048.
    assert block_sizes(8, 8, 2048, 512) == (16, 64, 16)  # 8 slots x 32 column blocks = TARGET_PROGRAMS
    assert block_sizes(8, 8, 512, 2048) == (16, 64, 64)
    assert block_sizes(4096, 256, 2048, 512) == (16, 64, 128)  # prefill: 16 rows per expert on average
    assert block_sizes(4096, 16, 24, 48) == (64, 32, 16)
    assert 8 * 512 // 16 >= TARGET_PROGRAMS


def test_bad_shapes_are_refused_naming_them():
    x, w = jnp.zeros((4, 8)), jnp.zeros((3, 8, 16))
    with pytest.raises(ValueError, match=r"\[E\] = \[3\]"):
        api.grouped_matmul(x, w, jnp.zeros((4,), jnp.int32), implementation="pallas")
    with pytest.raises(ValueError, match=r"\(3, 8, 16\)"):
        api.grouped_glu(x, w, jnp.zeros((3, 8, 12)), jnp.zeros((3,), jnp.int32), implementation="pallas")
    with pytest.raises(ValueError, match="dtype"):
        api.grouped_matmul(x, w.astype(jnp.bfloat16), jnp.zeros((3,), jnp.int32), implementation="pallas")
    with pytest.raises(ValueError, match="implementation='triton'"):
        api.grouped_matmul(x, w, jnp.zeros((3,), jnp.int32), implementation="triton")


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU (compiles the Triton kernel)")
class TestPallasGPU:
    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
    @pytest.mark.parametrize("name", SHAPES)
    def test_small(self, name, dtype):
        check(3, dtype=dtype, interpret=False, **SHAPES[name])

    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
    @pytest.mark.parametrize("tokens", [1, 8, 64])
    @pytest.mark.parametrize("layout", [(256, 8, 2048, 512), (512, 10, 2048, 512)])
    def test_published_moe_shapes(self, layout, tokens, dtype):
        """Qwen3.5-35B-A3B / Qwen3-Next-80B-A3B experts (E, top_k, H, I), random routing. Weights are
        drawn on the device; the float64 oracle reads only the chosen experts'."""
        groups, top_k, hidden, inter = layout
        rng = np.random.default_rng(tokens)
        chosen = np.sort(np.stack([rng.choice(groups, top_k, replace=False) for _ in range(tokens)]).reshape(-1))
        sizes = np.bincount(chosen, minlength=groups).astype(np.int32)
        keys = jax.random.split(jax.random.key(tokens), 3)
        x = jax.random.normal(keys[0], (tokens * top_k, hidden), dtype)
        w_gate, w_up = (jax.random.normal(key, (groups, hidden, inter), dtype) * hidden**-0.5 for key in keys[1:])
        glu = api.grouped_glu(x, w_gate, w_up, jnp.asarray(sizes), implementation="pallas", interpret=False)
        mm = api.grouped_matmul(x, w_gate, jnp.asarray(sizes), implementation="pallas", interpret=False)
        as64 = lambda a: np.asarray(a.astype(jnp.float32), np.float64)  # noqa: E731
        used = np.unique(chosen)
        gate64, up64 = {e: as64(w_gate[e]) for e in used}, {e: as64(w_up[e]) for e in used}
        x64 = as64(x)
        a = np.stack([row @ gate64[e] for row, e in zip(x64, chosen, strict=True)])
        b = np.stack([row @ up64[e] for row, e in zip(x64, chosen, strict=True)])
        for got, want in ((glu, a / (1 + np.exp(-a)) * b), (mm, a)):
            assert got.shape == want.shape and got.dtype == dtype
            assert rel_rms(got, want) < RTOL[dtype], rel_rms(got, want)
