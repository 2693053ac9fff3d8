"""Invariants of jaxspec.sampling: greedy = argmax, top-k / top-p support, keyed reproducibility."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from jaxspec.sampling import (
    SamplingParams,
    make_sampling_params,
    sample,
    token_key,
    validate_sampling,
    warp_probs,
)

warp_jit = jax.jit(warp_probs)
sample_jit = jax.jit(sample)

# Fixed shapes for the property tests so hypothesis examples reuse one compilation.
R, T, V = 3, 2, 12
POSITIONS = jnp.broadcast_to(jnp.arange(100, 100 + T, dtype=jnp.int32), (R, T))

# Logits from a coarse grid (frequent ties, -0.0 vs 0.0) and a fine one. The fine grid stops at
# 2**-10 so that scaling by 1/temperature never makes subnormals, which XLA on CPU flushes to zero
# (numpy does not), changing the order of near-zero logits between the test and the code.
logit_values = st.one_of(
    st.integers(-3, 3).map(float),
    st.just(-0.0),
    st.integers(-8 * 1024, 8 * 1024).map(lambda i: i / 1024),
)
logits_strategy = hnp.arrays(np.float32, (R, T, V), elements=logit_values)


def _params(temperature, top_k=0, top_p=1.0, seed=0, request_id=None) -> SamplingParams:
    return make_sampling_params(R, temperature, top_k, top_p, seed, request_id)


def _scaled(logits, temperature):
    """The temperature-scaled logits exactly as float32 computes them: [R, T, V]."""
    return np.asarray(logits, np.float32) / np.asarray(temperature, np.float32)[:, None, None]


def _top_k_sets(scaled, top_k):
    """Boolean [R, T, V]: the k largest scaled logits, ties broken towards the lower token id."""
    keep = np.zeros(scaled.shape, bool)
    for r in range(scaled.shape[0]):
        for t in range(scaled.shape[1]):
            order = np.argsort(-scaled[r, t], kind="stable")
            k = top_k[r] if top_k[r] > 0 else scaled.shape[-1]
            keep[r, t, order[:k]] = True
    return keep


def test_greedy_is_first_argmax():
    logits = np.random.default_rng(0).normal(size=(R, T, V)).astype(np.float32)
    logits[0, 0, [3, 7]] = 9.0  # a tie: the first index wins
    params = _params(0.0, top_k=[0, 2, 0], top_p=[1.0, 1.0, 0.5], seed=[1, 2, 3])
    tokens = sample_jit(logits, params, POSITIONS)
    np.testing.assert_array_equal(tokens, np.argmax(np.asarray(logits), axis=-1))
    assert tokens[0, 0] == 3
    probs = warp_jit(logits, params)
    np.testing.assert_array_equal(probs, jax.nn.one_hot(tokens, V))


@settings(max_examples=60, deadline=None)
@given(
    logits=logits_strategy,
    temperature=st.lists(st.floats(0.0625, 4.0, width=32), min_size=R, max_size=R),
    top_k=st.lists(st.integers(0, V + 2), min_size=R, max_size=R),
    seed=st.integers(0, 2**32 - 1),
)
def test_top_k_never_emits_outside_k_largest(logits, temperature, top_k, seed):
    params = _params(temperature, top_k=top_k, seed=seed)
    allowed = _top_k_sets(_scaled(logits, temperature), top_k)
    probs = np.asarray(warp_jit(jnp.asarray(logits), params))
    assert not np.any(probs[~allowed] > 0), "mass outside the k largest"
    np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-5)
    tokens = np.asarray(sample_jit(jnp.asarray(logits), params, POSITIONS))
    assert np.take_along_axis(allowed, tokens[..., None], -1).all()


@settings(max_examples=60, deadline=None)
@given(
    logits=logits_strategy,
    temperature=st.lists(st.floats(0.0625, 4.0, width=32), min_size=R, max_size=R),
    top_k=st.lists(st.integers(0, V), min_size=R, max_size=R),
    top_p=st.lists(st.floats(0.015625, 1.0, width=32), min_size=R, max_size=R),
    seed=st.integers(0, 2**32 - 1),
)
def test_top_p_never_emits_outside_nucleus(logits, temperature, top_k, top_p, seed):
    params = _params(temperature, top_k=top_k, top_p=top_p, seed=seed)
    scaled = _scaled(logits, temperature).astype(np.float64)
    in_k = _top_k_sets(scaled.astype(np.float32), top_k)
    probs64 = np.exp(scaled - scaled.max(-1, keepdims=True)) * in_k
    probs64 /= probs64.sum(-1, keepdims=True)
    nucleus = np.zeros_like(in_k)
    for r in range(R):
        for t in range(T):
            order = np.argsort(-scaled[r, t].astype(np.float32), kind="stable")
            p_sorted = probs64[r, t, order]
            before = np.cumsum(p_sorted) - p_sorted
            # float32 cannot decide a boundary closer than its rounding: skip those examples.
            assume(top_p[r] >= 1 or np.all(np.abs(before - top_p[r]) > 1e-4))
            nucleus[r, t, order] = (before < top_p[r]) & (p_sorted > 0) | (top_p[r] >= 1)
            nucleus[r, t, order[0]] = True  # the top token is always kept
    nucleus &= in_k
    probs = np.asarray(warp_jit(jnp.asarray(logits), params))
    assert not np.any(probs[~nucleus] > 0), "mass outside the nucleus"
    top = np.argsort(-scaled.astype(np.float32), axis=-1, kind="stable")[..., :1]
    assert np.all(np.take_along_axis(probs, top, -1) > 0), "top token dropped"
    tokens = np.asarray(sample_jit(jnp.asarray(logits), params, POSITIONS))
    assert np.take_along_axis(nucleus, tokens[..., None], -1).all()


def test_fixed_seed_reproduces_and_seed_matters():
    logits = jnp.asarray(np.random.default_rng(1).normal(size=(R, T, V)), jnp.float32)
    params = _params(2.0, top_k=[0, 9, 0], top_p=[1.0, 1.0, 0.95], seed=1234)
    tokens = np.stack([sample_jit(logits, params, POSITIONS + 2 * i) for i in range(8)])
    again = np.stack([sample_jit(logits, params, POSITIONS + 2 * i) for i in range(8)])
    np.testing.assert_array_equal(tokens, again)
    np.testing.assert_array_equal(tokens[0], sample(logits, params, POSITIONS))  # jit == eager
    other = dataclasses.replace(params, seed=params.seed + 1)
    assert np.any(tokens[0] != sample_jit(logits, other, POSITIONS))
    assert len(np.unique(tokens)) > 3  # positions feed the key: not one repeated draw


def test_request_sample_independent_of_batch_and_row():
    """A request's tokens depend on (seed, request_id, position), not on its batch or row."""
    rng = np.random.default_rng(2)
    mine = jnp.asarray(rng.normal(size=(1, T, V)), jnp.float32)
    others = jnp.asarray(rng.normal(size=(R, T, V)), jnp.float32)
    mine_pos = jnp.arange(17, 17 + T, dtype=jnp.int32)[None]
    # One filtered and one unfiltered request (exercises both branches of the sort skip).
    for settings_ in [dict(temperature=0.8, top_k=6, top_p=0.9), dict(temperature=1.3)]:
        mine_p = make_sampling_params(1, seed=99, request_id=[5], **settings_)
        results = []
        for row, other_p in [
            (0, make_sampling_params(2, temperature=[0.0, 2.0], top_k=[0, 3], seed=7)),
            (2, make_sampling_params(2, temperature=1.0, seed=[8, 9], request_id=[0, 1])),
            (1, make_sampling_params(2, temperature=0.7, seed=1, request_id=[6, 7])),
        ]:
            rows = [0, 1]
            rows.insert(row, "mine")

            def stack(mine_x, other_x, rows=rows):
                return jnp.concatenate([mine_x if i == "mine" else other_x[i:i + 1] for i in rows])

            params = jax.tree.map(stack, mine_p, other_p)
            tokens = sample_jit(stack(mine, others), params, stack(mine_pos, POSITIONS))
            probs = warp_jit(stack(mine, others), params)
            results.append((np.asarray(tokens[row]), np.asarray(probs[row])))
        for tokens, probs in results[1:]:
            np.testing.assert_array_equal(tokens, results[0][0])
            np.testing.assert_array_equal(probs, results[0][1])


def test_token_key_depends_on_each_coordinate():
    key_bits = jax.jit(lambda *args: jax.random.key_data(token_key(*args)))

    def bits(*args):
        return np.asarray(key_bits(*args))

    base = bits(1, 2, 3, 0)
    for args in [(2, 2, 3, 0), (1, 3, 3, 0), (1, 2, 4, 0), (1, 2, 3, 1)]:
        assert not np.array_equal(base, bits(*args))
    batched = key_bits(jnp.uint32(1), jnp.array([[2], [5]]), jnp.array([[3, 4]]), 0)
    assert batched.shape == (2, 2, 2)  # [2, 2] keys of two u32 words each
    np.testing.assert_array_equal(batched[0, 0], base)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(temperature=-0.5), "temperature=-0.5"),
        (dict(temperature=float("nan")), "temperature=nan"),
        (dict(temperature=[1.0, -1.0]), "temperature=-1.0"),
        (dict(top_k=-1), "top_k=-1"),
        (dict(top_k=2.5), "top_k=2.5"),
        (dict(top_p=0.0), "top_p=0.0"),
        (dict(top_p=1.5), "top_p=1.5"),
        (dict(top_p=[0.5, -0.1]), "top_p=-0.1"),
    ],
)
def test_bad_values_raise_naming_them(kwargs, name):
    full = dict(temperature=1.0, top_k=0, top_p=1.0) | kwargs
    with pytest.raises(ValueError, match=name):
        validate_sampling(**full)
    with pytest.raises(ValueError, match=name):
        make_sampling_params(2, **kwargs)


def test_make_sampling_params_shapes_and_bad_lengths():
    params = make_sampling_params(4, temperature=[0.0, 0.5, 1.0, 2.0], top_k=5, seed=3)
    assert params.temperature.dtype == jnp.float32 and params.top_k.dtype == jnp.int32
    assert params.seed.dtype == jnp.uint32 and params.request_id.dtype == jnp.int32
    np.testing.assert_array_equal(params.request_id, np.arange(4))
    np.testing.assert_array_equal(params.top_k, [5] * 4)
    assert len(jax.tree.leaves(params)) == 5  # a pytree of arrays: jit sees no static values
    with pytest.raises(ValueError, match="temperature has 2 entries"):
        make_sampling_params(3, temperature=[1.0, 1.0])
    with pytest.raises(ValueError, match="seed=-1"):
        make_sampling_params(1, seed=-1)


# ---- an independent float64 oracle for the warped distribution -----------------------------------

def warp_reference(logits, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """float64 numpy, one row of logits [V], in the order and with the semantics of HF's warpers
    (TemperatureLogitsWarper, then TopKLogitsWarper, then TopPLogitsWarper) and warp_probs'
    docstring: divide by the temperature; keep the top_k largest (0 = off; among equal logits the
    lower token id wins, as warp_probs documents, where HF would keep every tie); softmax over
    the kept tokens; keep the smallest prefix of them, by descending probability, whose mass
    reaches top_p (HF: drop the tokens whose ascending cumulative mass is <= 1 - top_p), the top
    token always; renormalise."""
    x = np.asarray(logits, np.float64) / temperature
    V = x.shape[-1]
    order = np.argsort(-x, kind="stable")  # descending, ties by token id
    kept = order[:top_k] if 0 < top_k < V else order
    p = np.exp(x[kept] - x[kept].max())
    p /= p.sum()
    if top_p < 1:
        before = np.cumsum(p) - p  # mass strictly before each kept token
        n = max(1, int(np.sum(before < top_p)))
        kept, p = kept[:n], p[:n] / p[:n].sum()
    out = np.zeros(V)
    out[kept] = p
    return out


# (temperature, top_k, top_p) per row of one [3, T, V] batch: temperature alone (below and above 1),
# top-k binding (k = 1, 2, V - 1), top-p binding, both, and filters that bind nothing (k >= V, p = 1).
WARP_CASES = [
    ((0.5, 2.0, 1.0), (0, 0, 0), (1.0, 1.0, 1.0)),
    ((0.7, 1.0, 1.6), (1, 2, V - 1), (1.0, 1.0, 1.0)),
    ((0.8, 1.0, 1.3), (0, 0, 0), (0.3, 0.6, 0.9)),
    ((0.6, 1.5, 2.5), (5, 8, 3), (0.5, 0.85, 0.95)),
    ((1.2, 0.9, 1.0), (V, V + 3, 0), (1.0, 1.0, 0.999)),
]


@pytest.mark.parametrize("temperature,top_k,top_p", WARP_CASES)
def test_warp_probs_equals_the_float64_reference(temperature, top_k, top_p):
    rng = np.random.default_rng(sum(top_k))
    logits = rng.normal(scale=2.0, size=(R, T, V)).astype(np.float32)  # no ties
    probs = np.asarray(warp_jit(jnp.asarray(logits), _params(list(temperature), list(top_k), list(top_p))))
    for r in range(R):
        for t in range(T):
            want = warp_reference(logits[r, t], temperature[r], top_k[r], top_p[r])
            np.testing.assert_allclose(probs[r, t], want, rtol=1e-5, atol=1e-7, err_msg=f"row {r}, position {t}")
            assert np.array_equal(probs[r, t] > 0, want > 0), f"support of row {r}, position {t}"


def test_warp_probs_ties_follow_the_docstring():
    """Equal logits: top-k keeps the lower token ids; the nucleus is counted in that order too."""
    logits = np.zeros((R, T, V), np.float32)
    logits[..., [2, 5, 7, 9]] = 1.0  # four tied maxima
    probs = np.asarray(warp_jit(jnp.asarray(logits), _params([1.0, 1.0, 0.5], [3, 0, 0], [1.0, 0.2, 0.2])))
    for r, (k, p, temperature) in enumerate([(3, 1.0, 1.0), (0, 0.2, 1.0), (0, 0.2, 0.5)]):
        for t in range(T):
            want = warp_reference(logits[r, t], temperature, k, p)
            np.testing.assert_allclose(probs[r, t], want, rtol=1e-5, atol=1e-7)
    assert np.flatnonzero(probs[0, 0]).tolist() == [2, 5, 7]


# Samples from `sample` itself against the reference, one chi-square test per setting: each of the
# R x DRAWS positions is an independent keyed draw from the same logits.
DRAWS = 2000
SAMPLE_CASES = [(0.6, 0, 1.0), (1.7, 0, 1.0), (1.3, 4, 1.0), (0.9, 0, 0.7), (1.2, 6, 0.8)]


@pytest.mark.parametrize("temperature,top_k,top_p", SAMPLE_CASES)
def test_sampled_tokens_follow_the_float64_reference(temperature, top_k, top_p):
    from scipy import stats

    row = np.random.default_rng(7).normal(scale=1.5, size=V).astype(np.float32)
    want = warp_reference(row, temperature, top_k, top_p)
    binding = (top_k > 0 and np.sum(want > 0) == top_k) or (top_p < 1 and np.sum(want > 0) < V)
    assert binding or (top_k == 0 and top_p == 1.0)  # every filter in the table removes tokens
    logits = jnp.broadcast_to(jnp.asarray(row), (R, DRAWS, V))
    positions = jnp.broadcast_to(jnp.arange(DRAWS, dtype=jnp.int32), (R, DRAWS))
    tokens = np.asarray(sample_jit(logits, _params(temperature, top_k, top_p, seed=5), positions)).ravel()
    counts = np.bincount(tokens, minlength=V)
    assert not counts[want == 0].any(), "a filtered token was drawn"
    support = want > 0
    pvalue = stats.chisquare(counts[support], want[support] * tokens.size).pvalue
    assert pvalue > 1e-3, (counts, np.round(want * tokens.size, 1))  # fixed seeds: never flaky
