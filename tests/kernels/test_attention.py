"""Paged span attention: reference vs dense numpy, Pallas vs reference, write_kv placement."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention import api, reference
from pallas_kernels.attention.kernel import paged_attention_pallas

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


def test_write_kv_places_tokens_and_padding_hits_only_null_page():
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
    touched[0, 0] = True  # invalid tokens (and the padding row) may land here
    for new, old in ((k_new, k_old), (v_new, v_old)):
        np.testing.assert_array_equal(new[~touched], old[~touched])
        np.testing.assert_array_equal(new[0, 1:], old[0, 1:])


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
    got = paged_attention_pallas(*step, scale=scale, interpret=interpret, pages_per_block=pages_per_block)
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


def test_api_dispatch():
    args, _ = make_case(4, span=2, n_heads=4, page_size=16, starts=[3], valids=[2], dtype=jnp.float32, **CASE)
    step = written_step(args)
    xla = api.paged_attention(*step, scale=0.25, implementation="xla")
    pallas = api.paged_attention(*step, scale=0.25, implementation="pallas", interpret=None if not ON_GPU else False)
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
    def test_qwen_shapes(self, dtype, k):
        """Qwen3-4B-like heads (32 q / 8 kv, D=128), page 16, contexts over several blocks."""
        pallas_vs_reference(
            6, k=k, group=4, n_kv=8, head_dim=128, page_size=16, dtype=dtype, interpret=False, starts=(100, 517, 33)
        )


def test_long_spans_run_in_query_blocks():
    """A span longer than the accumulator budget is cut into query blocks with the same result."""
    from pallas_kernels.attention import api

    assert api.span_block(64, 4, 256) == 16 and api.span_block(1, 4, 256) == 1 and api.span_block(8, 1, 16) == 8
    rng = np.random.default_rng(3)
    R, T, nh, nkv, D, page, P = 2, 12, 4, 2, 16, 4, 6
    q = jnp.asarray(rng.standard_normal((R, T, nh, D)), jnp.float32)
    kp = jnp.asarray(rng.standard_normal((1 + R * P, page, nkv, D)), jnp.float32)
    vp = jnp.asarray(rng.standard_normal((1 + R * P, page, nkv, D)), jnp.float32)
    tables = jnp.asarray(1 + np.arange(R * P).reshape(R, P), jnp.int32)
    start, valid = jnp.array([5, 0], jnp.int32), jnp.array([T, 7], jnp.int32)
    ref = api.paged_attention(q, kp, vp, tables, start, valid, scale=D ** -0.5, implementation="xla")
    got = api._pallas_in_span_blocks(q, kp, vp, tables, start, valid, scale=D ** -0.5, interpret=True,
                                     max_acc_bytes=2 * 2 * D * 4)  # two tokens per block
    mask = (np.arange(T)[None, :] < np.asarray(valid)[:, None])[..., None, None]
    np.testing.assert_allclose(np.asarray(got) * mask, np.asarray(ref) * mask, rtol=1e-5, atol=1e-5)
