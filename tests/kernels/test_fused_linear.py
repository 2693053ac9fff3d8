"""Fused projections (pallas_kernels/linear): the Pallas kernel and the XLA reference against a float64
oracle, for every combination of the RMSNorm before (none, Qwen3's, the hybrids' zero-centred), the
SwiGLU and the residual after, the GDN's gated norm and gated attention's sigmoid output gate before,
rows 1 .. 64, K and N that are not powers of two, one pass and split-K. Interpret mode on
CPU; the GPU class (`python -m pytest tests/kernels -k GPU`) runs the published projection shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.linear import api
from pallas_kernels.linear.kernel import (
    BLOCK_K,
    FMA_ACC_PER_THREAD,
    MAX_ROWS,
    PROGRAMS_PER_SM,
    WIDE_BLOCK_N,
    block_sizes,
    fma_block_k,
    fused_linear_pallas,
    split_count,
)

ON_GPU = jax.default_backend() == "gpu"
# As tests/kernels/test_moe_kernel.py: float32 within Triton's float32 dots' error over K products,
# bfloat16 within the roundings of x * g, the projections and the epilogue.
RTOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}
EPS = 1e-6


def oracle(x, w, g, residual, *, zero_centered: bool, glu: bool, gate=None) -> np.ndarray:
    """float64: the contract of pallas_kernels/linear/reference.py without its roundings."""
    if gate is not None:  # groups of len(g) channels, each normed on its own and gated
        groups = x.reshape(len(x), -1, len(g))
        y = groups / np.sqrt(np.mean(groups * groups, axis=2, keepdims=True) + EPS) * g
        x = y.reshape(x.shape) * gate / (1 + np.exp(-gate))
    elif g is not None:
        x = x / np.sqrt(np.mean(x * x, axis=1, keepdims=True) + EPS) * ((1.0 + g) if zero_centered else g)
    y = x @ w
    if glu:
        gate, up = y[:, : y.shape[1] // 2], y[:, y.shape[1] // 2 :]
        y = gate / (1 + np.exp(-gate)) * up
    return y if residual is None else residual + y


def case(seed, rows, k_dim, n_dim, *, norm: str | None, glu: bool, residual: bool, dtype, scale=3.0):
    """Inputs as dtype and their float64 values (the oracle sees the rounded inputs)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, k_dim)) * scale
    w = rng.standard_normal((k_dim, n_dim)) / k_dim**0.5
    g = None if norm is None else rng.standard_normal(k_dim) * 0.3 + (norm == "scale")
    r = rng.standard_normal((rows, n_dim // 2 if glu else n_dim)) if residual else None
    args = [None if a is None else jnp.asarray(a, dtype) for a in (x, w, g, r)]
    as64 = [None if a is None else np.asarray(a.astype(jnp.float32), np.float64) for a in args]
    return args, as64


def rel_rms(got, want) -> float:
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    return float(np.sqrt(np.mean((got - want) ** 2) / np.mean(want**2)))


def check(seed, rows, k_dim, n_dim, *, norm, glu, residual, dtype, implementation="pallas", interpret=None,
          weight_nk: bool = False, splits: int | None = None, blocks=None, body: str = "dot", merge: str = "kernel"):
    """weight_nk / splits / blocks / body / merge: the kernel itself (interpret as given) with the weight
    stored [N, K] / K split among that many programs / those (block_k, block_n) / that body / split-K's
    partial sums merged there."""
    args, as64 = case(seed, rows, k_dim, n_dim, norm=norm, glu=glu, residual=residual, dtype=dtype)
    zc = norm == "zero_centered"
    if weight_nk or splits is not None or blocks is not None or body != "dot" or merge != "kernel":
        x, w, g, r = args
        got = fused_linear_pallas(x, w.T if weight_nk else w, g, r, eps=EPS, zero_centered=zc, glu=glu,
                                  weight_nk=weight_nk, splits=splits, blocks=blocks, body=body, merge=merge,
                                  interpret=True if interpret is None else interpret)
    else:
        got = api.fused_linear(*args, eps=EPS, zero_centered=zc, glu=glu, implementation=implementation,
                               interpret=interpret)
    want = oracle(*as64, zero_centered=zc, glu=glu)
    assert got.shape == want.shape and got.dtype == dtype
    assert rel_rms(got, want) < RTOL[dtype], rel_rms(got, want)


# (rows, K, N): a decode step's two rows, a verify step's 8, the kernel's 64 rows (one 64-row block),
# K and N tails masked (K 72 = one 64-slab + 8; N 40 = two column blocks of 16 + 8).
SHAPES = {"decode": (2, 64, 96), "verify": (8, 128, 64), "most_rows": (64, 64, 32), "odd_dims": (5, 72, 40)}
EPILOGUES = {"norm": dict(norm="scale", glu=False, residual=False),
             "zero_centered_glu": dict(norm="zero_centered", glu=True, residual=False),
             "norm_glu": dict(norm="scale", glu=True, residual=False),
             "residual": dict(norm=None, glu=False, residual=True),
             "all": dict(norm="zero_centered", glu=True, residual=True)}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("epilogue", EPILOGUES)
@pytest.mark.parametrize("shape", SHAPES)
def test_pallas_equals_the_oracle(shape, epilogue, dtype):
    check(1, *SHAPES[shape], dtype=dtype, **EPILOGUES[epilogue])


@pytest.mark.parametrize("epilogue", ["norm", "zero_centered_glu", "all"])
@pytest.mark.parametrize("shape", ["decode", "odd_dims"])
def test_weights_stored_n_by_k_give_the_same_result(shape, epilogue):
    """The kernel's [N, K] weight layout (glu: gate rows, then up rows), K and N tails included."""
    check(2, *SHAPES[shape], dtype=jnp.float32, weight_nk=True, **EPILOGUES[epilogue])


def test_weights_stored_n_by_k_are_checked():
    x, w = jnp.zeros((2, 64)), jnp.zeros((64, 32))
    with pytest.raises(ValueError, match=r"w must be \[N, K\] with K = 64; got w \(64, 32\)"):
        fused_linear_pallas(x, w, weight_nk=True, interpret=True)
    assert fused_linear_pallas(x, w.T, weight_nk=True, interpret=True).shape == (2, 32)


@pytest.mark.parametrize("epilogue", ["zero_centered_glu", "all"])
def test_reference_equals_the_oracle(epilogue):
    check(2, *SHAPES["verify"], dtype=jnp.float32, implementation="xla", **EPILOGUES[epilogue])


def test_more_rows_than_the_kernel_takes_run_the_reference():
    args, as64 = case(3, MAX_ROWS + 1, 32, 16, norm="scale", glu=False, residual=True, dtype=jnp.float32)
    got = api.fused_linear(*args, eps=EPS, implementation="pallas")
    want = api.fused_linear(*args, eps=EPS, implementation="xla")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    with pytest.raises(ValueError, match=f"at most {MAX_ROWS} rows"):
        fused_linear_pallas(*args, eps=EPS, interpret=True)


def test_swept_blocks_agree_with_the_default():
    """The tail-masked and unmasked loads, one K slab and many: every block choice gives the oracle."""
    args, as64 = case(4, 8, 96, 64, norm="zero_centered", glu=True, residual=False, dtype=jnp.float32)
    want = oracle(*as64, zero_centered=True, glu=True)
    for blocks in ((16, 16), (32, 16), (128, 32), (64, 32)):
        got = fused_linear_pallas(*args, eps=EPS, zero_centered=True, glu=True, interpret=True, blocks=blocks)
        assert rel_rms(got, want) < RTOL[jnp.float32], blocks


@pytest.mark.parametrize("merge", ["kernel", "fused"])
@pytest.mark.parametrize("weight_nk", [False, True])
@pytest.mark.parametrize("epilogue", ["norm", "zero_centered_glu", "residual", "all"])
@pytest.mark.parametrize("shape, splits", [("decode", 2), ("decode", 4), ("odd_dims", 5), ("verify", 8)])
def test_split_k_gives_the_oracle(shape, splits, epilogue, weight_nk, merge):
    """K split among programs (16-wide slabs: 4, 5 and 8 of them), the partial sums and the norm's
    squares added, and the epilogue run, by the second kernel or by the last program of each column
    block (interpreted, programs run in order: the counter still has to reach splits - 1); K and N
    tails masked."""
    check(13, *SHAPES[shape], dtype=jnp.float32, weight_nk=weight_nk, splits=splits, blocks=(16, 16),
          merge=merge, **EPILOGUES[epilogue])


@pytest.mark.parametrize("merge", ["kernel", "fused"])
def test_split_k_in_bfloat16(merge):
    check(14, *SHAPES["verify"], dtype=jnp.bfloat16, splits=4, blocks=(32, 32), merge=merge, **EPILOGUES["all"])


def test_fused_merge_counts_every_split():
    """The fused merge with the norm's squares and the residual; an unknown merge is refused by name;
    one pass (splits = 1) has nothing to merge and takes either."""
    args, as64 = case(20, 2, 64, 48, norm="scale", glu=False, residual=True, dtype=jnp.float32)
    got = fused_linear_pallas(*args, eps=EPS, splits=4, blocks=(16, 16), merge="fused", interpret=True)
    want = oracle(*as64, zero_centered=False, glu=False)
    assert rel_rms(got, want) < RTOL[jnp.float32]
    with pytest.raises(ValueError, match=r"merge must be one of \('kernel', 'fused'\); got 'atomic'"):
        fused_linear_pallas(*args, eps=EPS, splits=4, blocks=(16, 16), merge="atomic", interpret=True)
    # one pass (splits = 1) ignores the merge
    one = fused_linear_pallas(*args, eps=EPS, splits=1, blocks=(16, 16), merge="fused", interpret=True)
    assert rel_rms(one, want) < RTOL[jnp.float32]


@pytest.mark.parametrize("epilogue", EPILOGUES)
@pytest.mark.parametrize("shape", SHAPES)
def test_fma_body_gives_the_oracle(shape, epilogue):
    """The CUDA-core body (per-thread products, K summed after the walk), rows padded to a power of
    two only, at its default blocks (which split K) and in one pass."""
    check(17, *SHAPES[shape], dtype=jnp.float32, body="fma", **EPILOGUES[epilogue])
    check(17, *SHAPES[shape], dtype=jnp.float32, body="fma", splits=1, **EPILOGUES[epilogue])


@pytest.mark.parametrize("merge", ["kernel", "fused"])
@pytest.mark.parametrize("weight_nk", [False, True])
@pytest.mark.parametrize("shape, splits, blocks", [("decode", 4, (16, 16)), ("odd_dims", 5, (16, 16)),
                                                   ("verify", 2, (32, 64))])
def test_fma_body_with_split_k_and_both_layouts(shape, splits, blocks, weight_nk, merge):
    check(18, *SHAPES[shape], dtype=jnp.float32, body="fma", weight_nk=weight_nk, splits=splits, blocks=blocks,
          merge=merge, **EPILOGUES["all"])


def test_fma_body_in_bfloat16():
    check(19, *SHAPES["decode"], dtype=jnp.bfloat16, body="fma", **EPILOGUES["all"])
    check(19, *SHAPES["odd_dims"], dtype=jnp.bfloat16, body="fma", weight_nk=True, **EPILOGUES["norm_glu"])


def test_fma_blocks_keep_the_products_per_thread():
    """fma_block_k: the most K rows (a power of two, 1 .. BLOCK_K) whose products fit
    FMA_ACC_PER_THREAD a thread; the default fma blocks pad the rows to a power of two only."""
    threads = 32 * 4
    for block_m, block_n, glu in ((1, 128, False), (2, 128, False), (2, 128, True), (8, 64, False), (64, 128, True)):
        k = fma_block_k(block_m, block_n, 4, glu)
        assert k & (k - 1) == 0 and 1 <= k <= BLOCK_K
        assert block_m * k * block_n * (1 + glu) <= FMA_ACC_PER_THREAD * threads or k == 1
        assert k == BLOCK_K or block_m * 2 * k * block_n * (1 + glu) > FMA_ACC_PER_THREAD * threads
    assert fma_block_k(2, 128, 4, False) == 16 and fma_block_k(2, 64, 4, True) == 16


def test_bodies_are_checked():
    x, w = jnp.zeros((2, 64)), jnp.zeros((64, 32))
    with pytest.raises(ValueError, match=r"body must be one of \('dot', 'fma'\); got 'wmma'"):
        fused_linear_pallas(x, w, body="wmma", interpret=True)
    assert fused_linear_pallas(x, w, body="fma", interpret=True).shape == (2, 32)


def test_splits_must_divide_the_k_slabs():
    x, w = jnp.zeros((2, 64)), jnp.zeros((64, 32))
    with pytest.raises(ValueError, match=r"divisor of the 4 K slabs \(64 / 16\); got 3"):
        fused_linear_pallas(x, w, blocks=(16, 16), splits=3, interpret=True)
    with pytest.raises(ValueError, match="got 0"):
        fused_linear_pallas(x, w, blocks=(16, 16), splits=0, interpret=True)
    assert fused_linear_pallas(x, w, blocks=(16, 16), splits=4, interpret=True).shape == (2, 32)


def test_block_sizes_fill_the_gpu_with_split_k():
    """128-column blocks for a wide projection, 64 for a narrow one, K slabs of BLOCK_K, and the
    fewest splits dividing the K slabs that give PROGRAMS_PER_SM programs per SM (132 SMs off the
    GPU, as an H200), unless the partial sums' traffic would pass an eighth of the weights' bytes."""
    from pallas_kernels.triton_common import device_sm_count

    target = PROGRAMS_PER_SM * device_sm_count()
    for rows, k_dim, n_out, glu, block_n in ((2, 2048, 8224, False, WIDE_BLOCK_N), (2, 2048, 6144, True, WIDE_BLOCK_N),
                                             (8, 6144, 2048, False, 64), (2, 2048, 2048, False, 64),
                                             (2, 9728, 2560, False, 64)):
        m, k, n, splits = block_sizes(rows, k_dim, n_out, 2, glu)
        assert (m, k, n) == (16, BLOCK_K, block_n), (k_dim, n_out)
        slabs, blocks = -(-k_dim // k), -(-n_out // n)
        assert slabs % splits == 0 and 2 * splits * rows * 4 <= k_dim * 2 / 8
        smaller = [s for s in range(1, splits) if slabs % s == 0]
        assert splits * blocks >= target or splits == max(s for s in range(1, slabs + 1) if slabs % s == 0
                                                          and 2 * s * rows * 4 <= k_dim * 2 / 8)
        assert all(s * blocks < target for s in smaller), (k_dim, n_out, splits)
    assert block_sizes(2, 2048, 8224, 2) == (16, 128, 128, 4)  # the H100 sweep's best [K, N] config
    assert block_sizes(64, 2048, 2048, 2)[3] == 1  # 64 rows: the partial sums would outweigh the split
    assert block_sizes(64, 24, 40, 4) == (64, 32, 64, 1)  # K under a slab: one slab of K rounded up
    assert split_count(2, 2048, 128, 1000, 2) == 1  # enough column blocks already


def test_bad_arguments_are_refused_naming_them():
    x, w = jnp.zeros((4, 8)), jnp.zeros((8, 6))
    with pytest.raises(ValueError, match=r"x \(4, 8\), w \(6, 8\)"):
        api.fused_linear(x, w.T, implementation="pallas")
    with pytest.raises(ValueError, match=r"even column count; got w \(8, 5\)"):
        api.fused_linear(x, jnp.zeros((8, 5)), glu=True)
    with pytest.raises(ValueError, match=r"norm must be \[K\] = \[8\]"):
        api.fused_linear(x, w, jnp.zeros((6,)))
    with pytest.raises(ValueError, match=r"residual must be the result's shape \(4, 3\)"):
        api.fused_linear(x, w, residual=jnp.zeros((4, 6)), glu=True)
    with pytest.raises(ValueError, match="bfloat16"):
        api.fused_linear(x, w.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="implementation='triton'"):
        api.fused_linear(x, w, implementation="triton")
    # a refused call leaves nothing behind: the next one runs
    assert api.fused_linear(x, w, implementation="pallas").shape == (4, 6)


def gated_case(seed, rows, k_dim, n_dim, group, *, dtype, gate_at=0, width=None):
    """x [rows, K], w, the group norm's weight [group], the gate's K columns from gate_at of a [rows, width]
    buffer, residual; as dtype and float64."""
    rng = np.random.default_rng(seed)
    width = width or k_dim
    arrays = (rng.standard_normal((rows, k_dim)) * 3, rng.standard_normal((k_dim, n_dim)) / k_dim**0.5,
              rng.standard_normal(group) * 0.3 + 1, rng.standard_normal((rows, width)) * 2,
              rng.standard_normal((rows, n_dim)))
    args = [jnp.asarray(a, dtype) for a in arrays]
    return args, [np.asarray(a.astype(jnp.float32), np.float64) for a in args]


def check_gated(seed, rows, k_dim, n_dim, group, *, dtype, gate_at=0, width=None, interpret=None,
                implementation="pallas", splits: int | None = None, merge: str = "kernel"):
    (x, w, g, z, r), (x64, w64, g64, z64, r64) = gated_case(seed, rows, k_dim, n_dim, group, dtype=dtype,
                                                            gate_at=gate_at, width=width)
    if splits is not None:
        got = fused_linear_pallas(x, w, g, r, gate=z, gate_at=gate_at, eps=EPS, splits=splits, merge=merge,
                                  interpret=True if interpret is None else interpret)
    else:
        got = api.fused_linear(x, w, g, r, gate=z, gate_at=gate_at, eps=EPS, implementation=implementation,
                               interpret=interpret)
    want = oracle(x64, w64, g64, r64, zero_centered=False, glu=False, gate=z64[:, gate_at:gate_at + k_dim])
    assert got.shape == want.shape and got.dtype == dtype
    assert rel_rms(got, want) < RTOL[dtype], rel_rms(got, want)


# (rows, K, N, group, gate_at, gate buffer width): the GDN's z read in place from the packed projection's
# output at an offset; groups of 16 and 32; N tail masked.
GATED = {"in_place": (2, 64, 48, 16, 40, 160), "own_buffer": (8, 96, 64, 32, 0, None),
         "most_rows": (64, 64, 40, 16, 8, 72)}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("implementation", ["pallas", "xla"])
@pytest.mark.parametrize("name", GATED)
def test_gated_norm_before_the_projection(name, implementation, dtype):
    rows, k_dim, n_dim, group, gate_at, width = GATED[name]
    check_gated(7, rows, k_dim, n_dim, group, dtype=dtype, gate_at=gate_at, width=width,
                implementation=implementation)


@pytest.mark.parametrize("merge", ["kernel", "fused"])
@pytest.mark.parametrize("name, splits", [("in_place", 2), ("in_place", 4), ("own_buffer", 3)])
def test_gated_norm_with_split_k(name, splits, merge):
    """One norm group per slab, the slabs of each column block split among programs."""
    rows, k_dim, n_dim, group, gate_at, width = GATED[name]
    check_gated(15, rows, k_dim, n_dim, group, dtype=jnp.float32, gate_at=gate_at, width=width, splits=splits,
                merge=merge)


def test_gated_norm_groups_the_kernel_cannot_tile_run_the_reference():
    """A group of 24 channels (not a power of two) runs the reference; the kernel refuses it by name."""
    (x, w, g, z, r), _ = gated_case(8, 4, 48, 32, 24, dtype=jnp.float32)
    got = api.fused_linear(x, w, g, r, gate=z, eps=EPS, implementation="pallas")
    want = api.fused_linear(x, w, g, r, gate=z, eps=EPS, implementation="xla")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    with pytest.raises(ValueError, match="power of two >= 16; got 24"):
        fused_linear_pallas(x, w, g, r, gate=z, eps=EPS, interpret=True)


def test_gated_norm_must_fit_its_gate():
    (x, w, g, z, r), _ = gated_case(9, 4, 64, 32, 16, dtype=jnp.float32, width=80)
    with pytest.raises(ValueError, match=r"K = 64 columns from gate_at = 20"):
        api.fused_linear(x, w, g, r, gate=z, gate_at=20, implementation="pallas")
    with pytest.raises(ValueError, match=r"norm \[G\] with G dividing K"):
        api.fused_linear(x, w, g[:10], r, gate=z, implementation="pallas")
    assert api.fused_linear(x, w, g, r, gate=z, gate_at=16, implementation="pallas").shape == (4, 32)


def check_output_gate(seed, rows, heads, head_dim, n_dim, extra, *, dtype, implementation="pallas", interpret=None,
                      splits: int | None = None, merge: str = "kernel"):
    """Gated attention's o projection: x [rows, heads * D] times sigmoid of the gate columns of a q
    projection buffer whose heads are [q_h | gate_h] (gate_at D, layout (D, 2 D)), then + residual;
    `extra` more columns (k, v) follow the heads in the buffer (0: the last gate ends the buffer)."""
    rng = np.random.default_rng(seed)
    k_dim = heads * head_dim
    arrays = (rng.standard_normal((rows, k_dim)), rng.standard_normal((k_dim, n_dim)) / k_dim**0.5,
              rng.standard_normal((rows, 2 * k_dim + extra)) * 2, rng.standard_normal((rows, n_dim)))
    x, w, buf, r = (jnp.asarray(a, dtype) for a in arrays)
    x64, w64, buf64, r64 = (np.asarray(a.astype(jnp.float32), np.float64) for a in (x, w, buf, r))
    kw = dict(gate=buf, gate_at=head_dim, gate_layout=(head_dim, 2 * head_dim))
    if splits is not None:
        got = fused_linear_pallas(x, w, None, r, blocks=(16, 16), splits=splits, merge=merge,
                                  interpret=True if interpret is None else interpret, **kw)
    else:
        got = api.fused_linear(x, w, None, r, implementation=implementation, interpret=interpret, **kw)
    z = buf64[:, :2 * k_dim].reshape(rows, heads, 2, head_dim)[:, :, 1].reshape(rows, k_dim)
    want = oracle(x64 / (1 + np.exp(-z)), w64, None, r64, zero_centered=False, glu=False)
    assert got.shape == want.shape and got.dtype == dtype
    assert rel_rms(got, want) < RTOL[dtype], rel_rms(got, want)


# (rows, heads, head dim, N, columns after the heads): a decode step's two rows with the last gate
# ending the buffer, a verify step's 8 with k / v columns after and an N tail, a head dim of 24 (a
# K slab spans heads), 64 rows.
OUTPUT_GATED = {"decode": (2, 4, 16, 48, 0), "verify": (8, 3, 32, 40, 64), "head_dim_24": (4, 4, 24, 32, 48),
                "most_rows": (64, 2, 64, 32, 0)}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("implementation", ["pallas", "xla"])
@pytest.mark.parametrize("name", OUTPUT_GATED)
def test_output_gate_before_the_projection(name, implementation, dtype):
    check_output_gate(12, *OUTPUT_GATED[name], dtype=dtype, implementation=implementation)


@pytest.mark.parametrize("merge", ["kernel", "fused"])
@pytest.mark.parametrize("name, splits", [("verify", 6), ("head_dim_24", 3)])
def test_output_gate_with_split_k(name, splits, merge):
    check_output_gate(16, *OUTPUT_GATED[name], dtype=jnp.float32, splits=splits, merge=merge)


def test_output_gate_layout_is_checked():
    x, w, buf = jnp.zeros((2, 64)), jnp.zeros((64, 8)), jnp.zeros((2, 128))
    with pytest.raises(ValueError, match=r"group dividing K = 64; got \(24, 48\)"):
        api.fused_linear(x, w, gate=buf, gate_layout=(24, 48), implementation="pallas")
    with pytest.raises(ValueError, match=r"group <= pitch.*got \(32, 16\)"):
        api.fused_linear(x, w, gate=buf, gate_layout=(32, 16), implementation="pallas")
    with pytest.raises(ValueError, match=r"through column 128\); got gate \(2, 128\)"):
        api.fused_linear(x, w, gate=buf, gate_at=33, gate_layout=(32, 64), implementation="pallas")
    assert api.fused_linear(x, w, gate=buf, gate_at=32, gate_layout=(32, 64), implementation="pallas").shape == (2, 8)


# Published projections (K, N, epilogue): Qwen3.5-2B's packed GDN input (norm), MLP (norm + SwiGLU, then
# down + residual) and out projection; Qwen3-4B's o projection and MLP.
PUBLISHED = {"2b_gdn_in": (2048, 8224, "norm"), "2b_gate_up": (2048, 12288, "zero_centered_glu"),
             "2b_down": (6144, 2048, "residual"), "4b_o": (4096, 2560, "residual"),
             "4b_gate_up": (2560, 19456, "norm_glu"), "4b_down": (9728, 2560, "residual")}


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU (compiles the Triton kernel)")
class TestPallasGPU:
    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
    @pytest.mark.parametrize("epilogue", EPILOGUES)
    @pytest.mark.parametrize("shape", SHAPES)
    def test_small(self, shape, epilogue, dtype):
        check(5, *SHAPES[shape], dtype=dtype, interpret=False, **EPILOGUES[epilogue])

    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
    @pytest.mark.parametrize("rows", [2, 8, 64])
    @pytest.mark.parametrize("name", PUBLISHED)
    def test_published_projections(self, name, rows, dtype):
        k_dim, n_dim, epilogue = PUBLISHED[name]
        check(6, rows, k_dim, n_dim, dtype=dtype, interpret=False, **EPILOGUES[epilogue])

    @pytest.mark.parametrize("rows", [2, 8])
    @pytest.mark.parametrize("name", PUBLISHED)
    def test_published_projections_one_pass(self, name, rows):
        """splits=1 (the defaults split K at these rows): the epilogue in the same kernel."""
        k_dim, n_dim, epilogue = PUBLISHED[name]
        check(6, rows, k_dim, n_dim, dtype=jnp.bfloat16, interpret=False, splits=1, **EPILOGUES[epilogue])

    @pytest.mark.parametrize("weight_nk", [False, True])
    @pytest.mark.parametrize("rows", [1, 2, 8])
    @pytest.mark.parametrize("name", PUBLISHED)
    def test_published_projections_fma_body(self, name, rows, weight_nk):
        k_dim, n_dim, epilogue = PUBLISHED[name]
        check(6, rows, k_dim, n_dim, dtype=jnp.bfloat16, interpret=False, body="fma", weight_nk=weight_nk,
              **EPILOGUES[epilogue])

    @pytest.mark.parametrize("body", ["dot", "fma"])
    @pytest.mark.parametrize("rows", [2, 8])
    @pytest.mark.parametrize("name", PUBLISHED)
    def test_published_projections_fused_merge(self, name, rows, body):
        """Split-K (the default splits) merged by the last program of each column block: on a GPU the
        programs race, so a missed or early count shows up as a wrong block."""
        k_dim, n_dim, epilogue = PUBLISHED[name]
        for seed in (6, 7):
            check(seed, rows, k_dim, n_dim, dtype=jnp.bfloat16, interpret=False, body=body, merge="fused",
                  **EPILOGUES[epilogue])

    @pytest.mark.parametrize("layout", [(2048, 2048, 8224, 6144), (6144, 5120, 16480, 10240)])
    def test_published_gated_out_projections_fused_merge(self, layout):
        k_dim, n_dim, width, z_at = layout
        check_gated(11, 2, k_dim, n_dim, 128, dtype=jnp.bfloat16, gate_at=z_at, width=width, interpret=False,
                    splits=4, merge="fused")

    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
    @pytest.mark.parametrize("epilogue", EPILOGUES)
    @pytest.mark.parametrize("shape", SHAPES)
    def test_small_fma_body(self, shape, epilogue, dtype):
        check(5, *SHAPES[shape], dtype=dtype, interpret=False, body="fma", **EPILOGUES[epilogue])

    @pytest.mark.parametrize("rows", [2, 8])
    @pytest.mark.parametrize("name", ["2b_gdn_in", "2b_gate_up", "2b_down"])
    def test_published_projections_n_by_k(self, name, rows):
        k_dim, n_dim, epilogue = PUBLISHED[name]
        check(6, rows, k_dim, n_dim, dtype=jnp.bfloat16, interpret=False, weight_nk=True, **EPILOGUES[epilogue])

    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
    @pytest.mark.parametrize("name", GATED)
    def test_gated_small(self, name, dtype):
        rows, k_dim, n_dim, group, gate_at, width = GATED[name]
        check_gated(10, rows, k_dim, n_dim, group, dtype=dtype, gate_at=gate_at, width=width, interpret=False)

    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
    @pytest.mark.parametrize("rows", [2, 8, 64])
    @pytest.mark.parametrize("layout", [(2048, 2048, 8224, 6144), (6144, 5120, 16480, 10240)])
    def test_published_gated_out_projections(self, layout, rows, dtype):
        """Qwen3.5-2B / 27B GDN out projections (K, N), z read at its offset in the packed projection's
        output (width, z offset); groups of 128."""
        k_dim, n_dim, width, z_at = layout
        check_gated(11, rows, k_dim, n_dim, 128, dtype=dtype, gate_at=z_at, width=width, interpret=False)

    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
    @pytest.mark.parametrize("name", OUTPUT_GATED)
    def test_output_gate_small(self, name, dtype):
        check_output_gate(13, *OUTPUT_GATED[name], dtype=dtype, interpret=False)

    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
    @pytest.mark.parametrize("rows", [2, 8, 64])
    @pytest.mark.parametrize("layout", [(8, 256, 2048, 1024), (24, 256, 5120, 2048)])
    def test_published_output_gated_o_projections(self, layout, rows, dtype):
        """Qwen3.5-2B / 27B gated attention o projections (heads, D, N, the k / v columns after q)."""
        check_output_gate(14, rows, *layout, dtype=dtype, interpret=False)
