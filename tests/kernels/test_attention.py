"""Paged span attention: reference vs dense numpy, Pallas (split-KV and one-pass) vs reference,
the split merge, write_kv placement. GPU-only classes: `python -m pytest tests/kernels -k GPU`."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from pallas_kernels.attention import api, reference
from pallas_kernels.attention.kernel import (
    MIN_DOT,
    _merge_splits,
    combine_splits,
    default_merge,
    default_num_splits,
    padded_head_dim,
    paged_attention_pallas,
)

ON_GPU = jax.default_backend() == "gpu"
RTOL = {jnp.float32: 1e-5, jnp.bfloat16: 5e-3}


def rel_rms(a, b) -> float:
    """rms(a - b) / rms(b), computed in float64."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b**2)))


def make_case(seed, *, span, n_heads, n_kv, head_dim, page_size, starts, valids, dtype):
    """A step batch over a pool holding each request's context; the last row is padding.

    Returns (args, dense) where args = (q, k_pages, v_pages, block_tables, start_pos, num_valid,
    k_span, v_span) and dense[r] = (K [L, nKV, D], V [L, nKV, D]) is request r's contiguous
    context including the span's valid tokens (L = start + num_valid), in float32.
    """
    rng = np.random.default_rng(seed)
    starts, valids = list(starts) + [0], list(valids) + [0]
    n_rows = len(starts)
    n_slots = max(-(-(s + span) // page_size) for s in starts) + 1
    n_pages = 1 + n_rows * n_slots
    def cast(x):
        return np.array(jnp.asarray(x, dtype).astype(jnp.float32))
    pool_shape = (n_pages, page_size, n_kv, head_dim)
    k_pages, v_pages = cast(rng.standard_normal(pool_shape)), cast(rng.standard_normal(pool_shape))
    block_tables = np.zeros((n_rows, n_slots), np.int32)
    ids = rng.permutation(np.arange(1, n_pages))  # distinct pages, never the null page
    dense = []
    for r, (start, valid) in enumerate(zip(starts, valids, strict=False)):
        if valid == 0:
            continue  # padding row: block table stays all null
        block_tables[r] = ids[r * n_slots : (r + 1) * n_slots]
        ctx_len = start + valid
        k_ctx = cast(rng.standard_normal((ctx_len, n_kv, head_dim)))
        v_ctx = cast(rng.standard_normal((ctx_len, n_kv, head_dim)))
        for p in range(start):  # the cached context, placed by hand
            k_pages[block_tables[r, p // page_size], p % page_size] = k_ctx[p]
            v_pages[block_tables[r, p // page_size], p % page_size] = v_ctx[p]
        dense.append((k_ctx, v_ctx))
    span_shape = (n_rows, span, n_kv, head_dim)
    k_span, v_span = rng.standard_normal(span_shape), rng.standard_normal(span_shape)
    for r, (start, valid) in enumerate(zip(starts, valids, strict=False)):
        if valid:
            k_span[r, :valid], v_span[r, :valid] = dense[r][0][start:], dense[r][1][start:]
    q = rng.standard_normal((n_rows, span, n_heads, head_dim))
    def as_j(x):
        return jnp.asarray(x, dtype)
    args = (
        as_j(q),
        as_j(k_pages),
        as_j(v_pages),
        jnp.asarray(block_tables),
        jnp.asarray(starts, jnp.int32),
        jnp.asarray(valids, jnp.int32),
        as_j(k_span),
        as_j(v_span),
    )
    return args, dense


def written_step(args):
    """Apply this step's write_kv; returns the attention arguments (q, pools, table, pos, valid)."""
    q, k_pages, v_pages, block_tables, start_pos, num_valid, k_span, v_span = args
    k_pages, v_pages = reference.write_kv(k_pages, v_pages, k_span, v_span, block_tables, start_pos, num_valid)
    return q, k_pages, v_pages, block_tables, start_pos, num_valid


def dense_attention(q, dense, starts, valids, scale):
    """Naive causal GQA attention per request over contiguous K/V; zeros for inert tokens."""
    q = np.asarray(q, np.float64)
    n_heads = q.shape[2]
    out = np.zeros_like(q)
    for r in range(len(dense)):
        k_ctx, v_ctx = (np.asarray(x, np.float64) for x in dense[r])
        group = n_heads // k_ctx.shape[1]
        for t in range(valids[r]):
            for h in range(n_heads):
                keys = k_ctx[: starts[r] + t + 1, h // group]  # positions 0 .. start + t
                logits = keys @ q[r, t, h] * scale
                w = np.exp(logits - logits.max())
                out[r, t, h] = (w / w.sum()) @ v_ctx[: starts[r] + t + 1, h // group]
    return out


CASE = {"n_kv": 2, "head_dim": 16}


@pytest.mark.parametrize("k", [0, 3, 7])
@pytest.mark.parametrize(("group", "page_size"), [(1, 8), (4, 4)])
def test_reference_matches_dense(k, group, page_size):
    span = 1 + k
    starts, valids = [5, 13], [span, max(1, span - 2)]  # second row: a partly valid span
    args, dense = make_case(
        0, span=span, n_heads=2 * group, page_size=page_size, starts=starts, valids=valids, dtype=jnp.float32, **CASE
    )
    step = written_step(args)
    got = reference.paged_attention(*step, scale=0.3)
    want = dense_attention(step[0], dense, starts, valids, 0.3)
    assert np.isfinite(np.asarray(got)).all()
    assert rel_rms(got, want) < 1e-5
    assert not np.asarray(got[-1]).any(), "padding row must give zeros"


def test_write_kv_places_tokens_and_padding_writes_nothing():
    span, page_size = 4, 4
    args, _ = make_case(
        1, span=span, n_heads=2, page_size=page_size, starts=[6, 3], valids=[4, 2], dtype=jnp.float32, **CASE
    )
    _, k_old, v_old, tables, starts, valids, k_span, v_span = (np.asarray(a) for a in args)
    _, k_new, v_new, *_ = (np.asarray(a) for a in written_step(args))
    touched = np.zeros(k_old.shape[:2], bool)
    for r in range(len(starts)):
        for t in range(valids[r]):
            p = starts[r] + t
            page, off = tables[r, p // page_size], p % page_size
            np.testing.assert_array_equal(k_new[page, off], k_span[r, t])
            np.testing.assert_array_equal(v_new[page, off], v_span[r, t])
            touched[page, off] = True
    assert not touched[0].any()
    for new, old in ((k_new, k_old), (v_new, v_old)):  # invalid tokens and the padding row: not even the null page
        np.testing.assert_array_equal(new[~touched], old[~touched])


def test_write_kv_writes_valid_tokens_past_the_pages_to_the_null_page():
    """A valid token past the request's allocated pages (table entry 0) lands in the null page, where
    later tokens of its span read it back; invalid tokens and rows of the null slot write nothing."""
    k_pages = jnp.arange(3 * 2 * 1 * 2, dtype=jnp.float32).reshape(3, 2, 1, 2)
    tables = jnp.array([[1, 0], [0, 0]], jnp.int32)  # row 0 owns page 1 only; row 1: the null slot
    k = -jnp.ones((2, 3, 1, 2), jnp.float32)
    new, _ = reference.write_kv(k_pages, k_pages, k, k, tables, jnp.array([0, 0], jnp.int32),
                                jnp.array([3, 0], jnp.int32))
    want = np.asarray(k_pages).copy()
    want[1] = -1  # positions 0 and 1 of row 0
    want[0, 0] = -1  # its position 2 maps to the null page, offset 0
    np.testing.assert_array_equal(np.asarray(new), want)


def pallas_vs_reference(
    seed,
    *,
    k,
    group,
    page_size,
    dtype,
    interpret,
    pages_per_block=None,
    head_dim=16,
    n_kv=2,
    starts=(5, 13),
    valids=None,
    num_splits=None,
    merge="fused",
    repeat=1,
):
    span = 1 + k
    valids = valids or [span] + [max(1, span - 2)] * (len(starts) - 1)
    args, _ = make_case(
        seed,
        span=span,
        n_heads=n_kv * group,
        n_kv=n_kv,
        head_dim=head_dim,
        page_size=page_size,
        starts=starts,
        valids=valids,
        dtype=dtype,
    )
    step = written_step(args)
    scale = head_dim**-0.5
    want = reference.paged_attention(*step, scale=scale)
    fn = jax.jit(functools.partial(paged_attention_pallas, scale=scale, interpret=interpret,
                                   pages_per_block=pages_per_block, num_splits=num_splits, merge=merge))
    got = fn(*step)
    for _ in range(repeat - 1):  # the fused merge's counters and partials: no race changes a bit
        np.testing.assert_array_equal(np.asarray(fn(*step).astype(jnp.float32)), np.asarray(got.astype(jnp.float32)))
    assert got.shape == want.shape and got.dtype == want.dtype
    assert np.isfinite(np.asarray(got.astype(jnp.float32))).all()
    assert not np.asarray(got[-1].astype(jnp.float32)).any(), "padding row must give zeros"
    assert rel_rms(got.astype(jnp.float32), want.astype(jnp.float32)) < RTOL[dtype]


# Interpret mode is slow: each case is one (k, group, page_size) point, not the full product.
# pages_per_block * page_size = 16 keys per loop step, so contexts of 6..28 keys span 1..2 blocks.
INTERPRET_CASES = [
    {"k": 0, "group": 2, "page_size": 4, "pages_per_block": 4},
    {"k": 1, "group": 1, "page_size": 8, "pages_per_block": 2},
    {"k": 3, "group": 4, "page_size": 4, "pages_per_block": 4},
    {"k": 7, "group": 2, "page_size": 8, "pages_per_block": 2},
    {"k": 15, "group": 1, "page_size": 4, "pages_per_block": 4},
    {"k": 2, "group": 2, "page_size": 8, "pages_per_block": None},  # T = 3 (not a power of two); one block
]


@pytest.mark.parametrize("case", INTERPRET_CASES, ids=lambda c: f"k{c['k']}-g{c['group']}-ps{c['page_size']}")
def test_pallas_interpret_float32(case):
    pallas_vs_reference(2, dtype=jnp.float32, interpret=True, **case)


@pytest.mark.parametrize("case", INTERPRET_CASES[2:4], ids=lambda c: f"k{c['k']}-g{c['group']}")
def test_pallas_interpret_bfloat16(case):
    pallas_vs_reference(3, dtype=jnp.bfloat16, interpret=True, **case)


# Split-KV at page_size 16 with one page (16 keys) per block: the rows hold 5+T (one block, shorter
# than any split), 100+T and 40+T keys (several blocks per split, blocks shared unevenly) and the
# last row is padding. Splits go past the longest row's blocks (empty splits must merge as nothing).
SPLIT_STARTS = (5, 100, 40)
SPLIT_CASES = [  # (T, GQA group, splits)
    (2, 2, 4),
    (4, 4, 2),
    (8, 2, 5),
    (16, 1, 3),
    (1, 4, 9),  # 9 splits > the 7 blocks of the longest row
]


@pytest.mark.parametrize(("span", "group", "splits"), SPLIT_CASES, ids=lambda x: str(x))
def test_split_kv_interpret_float32(span, group, splits):
    pallas_vs_reference(7, k=span - 1, group=group, page_size=16, pages_per_block=1, dtype=jnp.float32,
                        interpret=True, starts=SPLIT_STARTS, num_splits=splits)


@pytest.mark.parametrize(("span", "group", "splits"), [(4, 2, 3), (16, 4, 2)], ids=lambda x: str(x))
def test_split_kv_interpret_bfloat16(span, group, splits):
    pallas_vs_reference(8, k=span - 1, group=group, page_size=16, pages_per_block=1, dtype=jnp.bfloat16,
                        interpret=True, starts=SPLIT_STARTS, num_splits=splits)


@pytest.mark.parametrize(("span", "group", "splits"), [(2, 2, 4), (1, 4, 9)], ids=lambda x: str(x))
def test_split_kv_merge_kernel_interpret(span, group, splits):
    """merge="kernel": the partials of every split go out and a second launch merges them."""
    pallas_vs_reference(7, k=span - 1, group=group, page_size=16, pages_per_block=1, dtype=jnp.float32,
                        interpret=True, starts=SPLIT_STARTS, num_splits=splits, merge="kernel")


def test_fused_merge_is_one_launch():
    """Decode-sized spans merge inside the split kernel (one pallas_call); merge="kernel" and
    verify-sized spans on the same heads add the merge launch."""
    from tests.jaxprs import pallas_calls

    nh, nkv, D, page, P = 32, 8, 128, 16, 64
    pool = jnp.zeros((8, page, nkv, D), jnp.bfloat16)
    rest = (jnp.zeros((1, P), jnp.int32), jnp.zeros((1,), jnp.int32), jnp.ones((1,), jnp.int32))

    def calls(T, **kw):
        fn = functools.partial(paged_attention_pallas, scale=0.1, interpret=True, num_splits=16, **kw)
        return pallas_calls(fn, jnp.zeros((1, T, nh, D), jnp.bfloat16), pool, pool, *rest)

    assert default_merge(16, 1, nh // nkv, D) == "fused" and calls(1) == 1
    assert calls(1, merge="kernel") == 2
    assert default_merge(16, 8, nh // nkv, D) == "kernel" and calls(8) == 2


def test_merge_is_checked():
    args, _ = make_case(4, span=2, n_heads=4, page_size=16, starts=[3], valids=[2], dtype=jnp.float32, **CASE)
    with pytest.raises(ValueError, match=r"merge='tree' must be one of \('fused', 'kernel'\) or None"):
        paged_attention_pallas(*written_step(args), scale=0.25, interpret=True, merge="tree")


def test_one_pass_interpret():
    """num_splits = 1: the kernel normalises in place (no partials), as the previous kernel."""
    pallas_vs_reference(9, k=3, group=2, page_size=16, pages_per_block=1, dtype=jnp.float32, interpret=True,
                        starts=SPLIT_STARTS, num_splits=1)


def _partials(logits, values, cuts):
    """Split partials of softmax(logits) @ values over key ranges `cuts`, as the kernel writes them:
    (acc [S, M, D], m [S, M], l [S, M]); an empty range gives m = MASK_VALUE, l = 0, acc = 0."""
    acc, m, denom = [], [], []
    for a, b in cuts:
        s, v = logits[:, a:b], values[a:b]
        mx = s.max(axis=1) if b > a else np.full(logits.shape[0], reference.MASK_VALUE)
        p = np.exp(s - mx[:, None])
        acc.append(p @ v), m.append(mx), denom.append(p.sum(axis=1))
    return tuple(jnp.asarray(np.stack(x), jnp.float32) for x in (acc, m, denom))


def test_combine_splits_rescales_and_ignores_empty_splits():
    """Splits with different maxima (scaled logits: a missing rescale is far off), an empty split,
    and a row no split saw (all-empty: zeros, not NaN)."""
    rng = np.random.default_rng(10)
    logits, values = 8 * rng.standard_normal((3, 12)), rng.standard_normal((12, 5))
    logits[1, 7:] += 30.0  # row 1's mass sits in the last split
    want = np.exp(logits - logits.max(1, keepdims=True))
    want = (want / want.sum(1, keepdims=True)) @ values
    acc, m, denom = _partials(logits, values, [(0, 4), (4, 4), (4, 12)])
    got = np.asarray(combine_splits(acc, m, denom))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    empty = _partials(logits, values, [(0, 0), (0, 0)])
    got = np.asarray(combine_splits(*empty))
    assert np.isfinite(got).all() and not got.any()


@pytest.mark.parametrize(("splits", "span", "group", "head_dim"), [(4, 2, 4, 128), (1, 3, 2, 24), (32, 1, 4, 16),
                                                                 (8, 16, 2, 48)])
def test_merge_kernel_equals_combine_splits(splits, span, group, head_dim):
    """The merge kernel (split partials -> the unpacked output in one launch) against
    combine_splits followed by the unpacking it replaced: an empty split, a split holding all the
    mass, pad rows (M > T * G) and padded head columns (D not a power of two) included."""
    r, nkv = 2, 2
    m_rows, dp = max(MIN_DOT, pl.next_power_of_2(span * group)), padded_head_dim(head_dim)
    rng = np.random.default_rng(splits + span)
    acc = rng.standard_normal((r, nkv, splits, m_rows, dp)).astype(np.float32)
    m = 4 * rng.standard_normal((r, nkv, splits, m_rows)).astype(np.float32)
    denom = rng.uniform(0.5, 2.0, (r, nkv, splits, m_rows)).astype(np.float32)
    m[:, :, 0] += 20.0  # the first split holds the mass: a missing rescale is far off
    if splits > 1:
        m[:, :, -1], denom[:, :, -1], acc[:, :, -1] = reference.MASK_VALUE, 0.0, 0.0  # an empty split
    acc[..., head_dim:] = 0.0  # padded columns, as the kernel writes them
    out = jax.ShapeDtypeStruct((r * span * nkv * group, head_dim), jnp.float32)
    got = _merge_splits((jnp.asarray(acc), jnp.asarray(m), jnp.asarray(denom)), out, group=group, span=span,
                        head_dim=head_dim, interpret=True, num_warps=4)
    merged = np.asarray(combine_splits(jnp.asarray(acc), jnp.asarray(m), jnp.asarray(denom)))  # [r, nkv, M, Dp]
    want = merged[:, :, :span * group, :head_dim].reshape(r, nkv, span, group, head_dim).transpose(0, 2, 1, 3, 4)
    np.testing.assert_allclose(np.asarray(got).reshape(want.shape), want, rtol=1e-5, atol=1e-6)


def test_default_num_splits():
    """About 2 programs per SM, at most one split per block of the longest row, at least 1, a
    power of two."""
    assert default_num_splits(1, 8, 2560, 4, sm_count=132) == 32  # Qwen3-4B, batch 1, 40k-token table: 33 -> 32
    assert default_num_splits(8, 8, 2560, 4, sm_count=132) == 4  # 5 -> 4
    assert default_num_splits(32, 8, 2560, 4, sm_count=132) == 2
    assert default_num_splits(64, 8, 2560, 4, sm_count=132) == 1
    assert default_num_splits(1, 8, 8, 4, sm_count=132) == 2  # a 2-block table
    assert default_num_splits(1, 8, 12, 4, sm_count=132) == 2  # a 3-block table
    assert default_num_splits(1, 1, 10**6, 4, sm_count=132) == 64  # capped


def test_default_merge():
    """Fused while one (request, kv head)'s partials (splits x pow2(T * G) x padded D) are <= 16K
    elements, else the merge kernel."""
    assert default_merge(32, 1, 4, 128) == "fused"  # Qwen3-4B heads, decode, 32 splits: 16K
    assert default_merge(64, 1, 4, 128) == "kernel"  # 32K
    assert default_merge(64, 1, 4, 256) == "kernel"  # Qwen3.5-2B heads: 64K
    assert default_merge(32, 8, 4, 128) == "kernel"  # verify k = 7: 128K
    assert default_merge(4, 8, 4, 128) == "fused"  # batch 8's 4 splits
    assert default_merge(3, 1, 3, 24) == "fused"  # padded: 4 x 4 x 32


def test_api_dispatch():
    args, _ = make_case(4, span=2, n_heads=4, page_size=16, starts=[3], valids=[2], dtype=jnp.float32, **CASE)
    step = written_step(args)
    xla = api.paged_attention(*step, scale=0.25, implementation="xla")
    for impl in ("pallas", "pallas_onepass"):
        pallas = api.paged_attention(*step, scale=0.25, implementation=impl, interpret=None if not ON_GPU else False)
        assert rel_rms(pallas, xla) < 1e-5
    assert api.write_kv is reference.write_kv
    with pytest.raises(ValueError, match="implementation"):
        api.paged_attention(*step, scale=0.25, implementation="cuda")


@pytest.mark.skipif(not ON_GPU, reason="compiled Pallas (Triton) needs a GPU")
class TestPallasGPU:
    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
    @pytest.mark.parametrize("k", [0, 1, 3, 7, 15])
    @pytest.mark.parametrize("group", [1, 2, 4])
    def test_small(self, dtype, k, group):
        pallas_vs_reference(5, k=k, group=group, page_size=4, dtype=dtype, interpret=False, pages_per_block=4)

    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
    @pytest.mark.parametrize("k", [0, 7])
    @pytest.mark.parametrize("splits", [None, 1])
    def test_qwen_shapes(self, dtype, k, splits):
        """Qwen3-4B-like heads (32 q / 8 kv, D=128), page 16, contexts over several blocks."""
        pallas_vs_reference(
            6, k=k, group=4, n_kv=8, head_dim=128, page_size=16, dtype=dtype, interpret=False, starts=(100, 517, 33),
            num_splits=splits,
        )

    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
    @pytest.mark.parametrize("span", [1, 2, 4, 8, 16])
    @pytest.mark.parametrize(("group", "splits"), [(1, 7), (2, 33), (4, None)])
    def test_split_kv(self, dtype, span, group, splits):
        """Split-KV over long and short rows (one row of 4000 keys, one shorter than a split)."""
        pallas_vs_reference(11, k=span - 1, group=group, n_kv=4, head_dim=128, page_size=16, dtype=dtype,
                            interpret=False, starts=(4000, 5, 700), num_splits=splits)

    @pytest.mark.parametrize("merge", ["fused", "kernel"])
    @pytest.mark.parametrize(("span", "splits"), [(1, 64), (8, 32)])
    def test_merge_paths_repeat_bitwise(self, merge, span, splits):
        """Both merges over rows of 8000, 3000 and 40 keys, 64 splits (most of a short row's splits
        empty), 20 calls: a race between the last split and the others would change bits."""
        pallas_vs_reference(13, k=span - 1, group=4, n_kv=8, head_dim=128, page_size=16, dtype=jnp.bfloat16,
                            interpret=False, starts=(8000, 3000, 40), num_splits=splits, merge=merge, repeat=20)

    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
    @pytest.mark.parametrize(("head_dim", "group"), [(256, 6), (24, 2), (48, 4), (80, 1)])
    def test_head_dims(self, dtype, head_dim, group):
        """Qwen3.5-27B-like D=256 with group 6, and head dims that are not powers of two."""
        pallas_vs_reference(12, k=3, group=group, n_kv=2, head_dim=head_dim, page_size=16, dtype=dtype,
                            interpret=False, starts=(900, 17))

    @pytest.mark.parametrize("splits", [1, 2])
    def test_last_loop_step_past_the_table_width(self, splits):
        """The compiled masked table load: 7 slots, 4 pages per loop step (see the CPU test)."""
        pallas_vs_reference(11, k=3, group=2, page_size=4, pages_per_block=4, dtype=jnp.float32, interpret=False,
                            starts=(17, 2), num_splits=splits)


@pytest.mark.parametrize("T", [12, 11])
def test_long_spans_run_in_query_blocks(T):
    """A span longer than the accumulator budget is cut into query blocks (the last one padded
    when T is not a multiple) with the same result, all in one kernel launch."""
    import functools

    from pallas_kernels.attention import api
    from tests.jaxprs import pallas_calls

    assert api.span_block(64, 4, 256) == 16 and api.span_block(1, 4, 256) == 1 and api.span_block(8, 1, 16) == 8
    rng = np.random.default_rng(3)
    R, nh, nkv, D, page, P = 2, 4, 2, 16, 4, 6
    q = jnp.asarray(rng.standard_normal((R, T, nh, D)), jnp.float32)
    kp = jnp.asarray(rng.standard_normal((1 + R * P, page, nkv, D)), jnp.float32)
    vp = jnp.asarray(rng.standard_normal((1 + R * P, page, nkv, D)), jnp.float32)
    tables = jnp.asarray(1 + np.arange(R * P).reshape(R, P), jnp.int32)
    start, valid = jnp.array([5, 0], jnp.int32), jnp.array([T, 7], jnp.int32)
    ref = api.paged_attention(q, kp, vp, tables, start, valid, scale=D ** -0.5, implementation="xla")
    blocked = functools.partial(api._pallas_in_span_blocks, scale=D ** -0.5, interpret=True,
                                max_acc_bytes=2 * 2 * D * 4)  # two tokens per block
    got = blocked(q, kp, vp, tables, start, valid)
    assert pallas_calls(blocked, q, kp, vp, tables, start, valid) == 1
    mask = (np.arange(T)[None, :] < np.asarray(valid)[:, None])[..., None, None]
    np.testing.assert_allclose(np.asarray(got) * mask, np.asarray(ref) * mask, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("splits", [1, 2])
def test_last_loop_step_past_the_table_width(splits):
    """Tables of 7 slots, 4 pages per loop step: the second step's slot 7 does not exist (read as
    the null page, masked); the row whose context reaches slot 5 still reads its keys there. The
    interpreter clamps a stray index, so on CPU this checks the result; the GPU classes run the
    masked load for real."""
    pallas_vs_reference(11, k=3, group=2, page_size=4, pages_per_block=4, dtype=jnp.float32, interpret=True,
                        starts=(17, 2), num_splits=splits)


def test_table_is_not_padded_to_whole_loop_steps():
    """A block table of 33 slots with 4 pages per loop step: the kernel reads the last step's
    missing slots as the null page instead of padding the table (a copy per call and layer)."""
    R, T, nh, nkv, D, page, P = 1, 2, 4, 2, 16, 16, 33
    q = jnp.zeros((R, T, nh, D), jnp.float32)
    pool = jnp.zeros((8, page, nkv, D), jnp.float32)
    fn = functools.partial(paged_attention_pallas, scale=0.25, interpret=True, pages_per_block=4)
    jaxpr = jax.make_jaxpr(fn)(q, pool, pool, jnp.zeros((R, P), jnp.int32), jnp.zeros((R,), jnp.int32),
                               jnp.ones((R,), jnp.int32))
    outer = {str(e.primitive) for e in jaxpr.jaxpr.eqns}
    assert "pallas_call" in outer and "pad" not in outer, outer


@pytest.mark.skipif(ON_GPU, reason="the GPU tests compile the kernel for real")
@pytest.mark.parametrize(("head_dim", "splits", "P"), [(128, 8, 32), (128, 1, 33), (24, 4, 33)])
def test_kernel_lowers_to_triton(head_dim, splits, P):
    """The Pallas -> Triton lowering rules (power-of-two tensors, gathers, masked loads, a table
    width that is not whole loop steps) on CPU."""
    from tests.kernels.test_gdn_pallas import _lower_for_cuda

    R, T, nh, nkv, n_pages, page, bf, i = 2, 4, 8, 2, 64, 16, jnp.bfloat16, jnp.int32
    fn = functools.partial(paged_attention_pallas, scale=0.1, num_splits=splits)
    pool = ((n_pages, page, nkv, head_dim), bf)
    hlo = _lower_for_cuda(fn, ((R, T, nh, head_dim), bf), pool, pool, ((R, P), i), ((R,), i), ((R,), i))
    assert "paged_span_attention" in hlo
