"""Invariants of the rejection sampler: greedy semantics, zero drafts == sample, lossless output."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.sampling import (
    STREAM_ACCEPT,
    STREAM_RESIDUAL,
    categorical,
    make_sampling_params,
    sample,
    token_key,
    warp_probs,
)
from jaxspec.speculative.verify import rejection_sample
from tests.test_sampling import warp_reference

verify_jit = jax.jit(rejection_sample)
sample_jit = jax.jit(sample)
warp_jit = jax.jit(warp_probs)


@jax.jit
def categorical_rows(key, probs):
    """Independent draws from probs [R, k, V] -> [R, k] int32 (a drafter's own randomness)."""
    keys = jax.random.split(key, probs.shape[0] * probs.shape[1])
    flat = jax.vmap(categorical)(keys, probs.reshape(-1, probs.shape[-1]))
    return flat.reshape(probs.shape[:2])


# One small shape shared by the hand-made tests, so they reuse one compilation per draft mode.
ROWS, SMALL_K, SMALL_V = 8, 3, 7
SMALL_POSITIONS = jnp.broadcast_to(jnp.arange(40, 41 + SMALL_K, dtype=jnp.int32), (ROWS, 1 + SMALL_K))


def _peaked_logits(argmaxes, vocab):
    """[R, len, V] logits whose argmax at position i of row r is argmaxes[r][i]."""
    noise = np.random.default_rng(0).uniform(size=(len(argmaxes), len(argmaxes[0]), vocab))
    return jnp.asarray(noise + 5.0 * np.eye(vocab)[np.asarray(argmaxes)], jnp.float32)


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_greedy_acceptance(with_draft_probs):
    target_argmax = [2, 4, 1, 5]  # target argmax at positions 0..3 for every row
    cases = [  # (drafts, num_drafts) -> (tokens, num_emitted)
        (([2, 4, 1], 3), ([2, 4, 1, 5], 4)),  # all accepted -> bonus = argmax at position 3
        (([2, 3, 1], 3), ([2, 4, 0, 0], 2)),  # first mismatch at 1 -> target argmax there
        (([0, 4, 1], 3), ([2, 0, 0, 0], 1)),  # mismatch at 0
        (([2, 4, 6], 3), ([2, 4, 1, 0], 3)),  # mismatch at the last draft
        (([2, 0, 1], 3), ([2, 4, 0, 0], 2)),  # a later match after a mismatch does not count
        (([2, 4, 1], 2), ([2, 4, 1, 0], 3)),  # masked tail: bonus at position 2
        (([2, 4, 3], 2), ([2, 4, 1, 0], 3)),  # a wrong draft in the masked tail is ignored
        (([2, 4, 1], 0), ([2, 0, 0, 0], 1)),  # no drafts: plain greedy
    ]
    logits = _peaked_logits([target_argmax] * ROWS, SMALL_V)
    drafts = jnp.asarray([c[0][0] for c in cases], jnp.int32)
    num_drafts = jnp.asarray([c[0][1] for c in cases], jnp.int32)
    draft_probs = None
    if with_draft_probs:  # greedy rows ignore q entirely
        q_logits = np.random.default_rng(3).normal(size=(ROWS, SMALL_K, SMALL_V))
        draft_probs = jax.nn.softmax(jnp.asarray(q_logits, jnp.float32))
    params = make_sampling_params(ROWS, temperature=0.0, top_k=2, top_p=0.5, seed=11)
    tokens, num_emitted = verify_jit(logits, drafts, draft_probs, params, SMALL_POSITIONS,
                                     num_drafts)
    np.testing.assert_array_equal(tokens, [c[1][0] for c in cases])
    np.testing.assert_array_equal(num_emitted, [c[1][1] for c in cases])
    assert tokens.dtype == jnp.int32 and num_emitted.dtype == jnp.int32


def test_greedy_matches_sequential_reference():
    """Random drafts (most equal to the argmax): compare with a step-by-step loop."""
    k = SMALL_K
    params = make_sampling_params(ROWS, temperature=0.0)
    rng = np.random.default_rng(4)
    for _ in range(8):
        logits = rng.normal(size=(ROWS, 1 + k, SMALL_V)).astype(np.float32)
        argmax = np.argmax(logits, -1)
        coin = rng.uniform(size=(ROWS, k)) < 0.8
        drafts = np.where(coin, argmax[:, :k], rng.integers(0, SMALL_V, (ROWS, k))).astype(np.int32)
        num_drafts = rng.integers(0, k + 1, ROWS).astype(np.int32)
        tokens, num_emitted = verify_jit(logits, drafts, None, params, SMALL_POSITIONS, num_drafts)
        for r in range(ROWS):
            want = []
            for i in range(int(num_drafts[r]) + 1):
                want.append(int(argmax[r, i]))
                if i == num_drafts[r] or drafts[r, i] != argmax[r, i]:
                    break
            assert num_emitted[r] == len(want)
            np.testing.assert_array_equal(tokens[r], want + [0] * (1 + k - len(want)))


@pytest.mark.parametrize("k", [0, SMALL_K])
def test_zero_drafts_equals_plain_sample(k):
    """Zero (or all-masked) drafts: the emitted token is exactly `sample` at that position."""
    logits = jnp.asarray(np.random.default_rng(5).normal(size=(ROWS, 1 + k, SMALL_V)) * 2, jnp.float32)
    params = make_sampling_params(
        ROWS, temperature=[0.0, 0.5, 1.0, 1.5] * 2, top_k=[0, 0, 3, 5] * 2,
        top_p=[1.0, 0.8, 1.0, 0.9, 1.0, 1.0, 0.5, 1.0], seed=list(range(ROWS)),
        request_id=[3, 1, 4, 1, 5, 9, 2, 6])
    positions = SMALL_POSITIONS[:, :1 + k]
    plain = sample_jit(logits[:, :1], params, positions[:, :1])
    uniform_q = jnp.full((ROWS, k, SMALL_V), 1.0 / SMALL_V)
    for draft_probs in (None, uniform_q) if k else (None,):
        tokens, num_emitted = verify_jit(logits, jnp.ones((ROWS, k), jnp.int32), draft_probs,
                                         params, positions, jnp.zeros(ROWS, jnp.int32))
        np.testing.assert_array_equal(tokens[:, :1], plain)
        np.testing.assert_array_equal(tokens[:, 1:], 0)
        np.testing.assert_array_equal(num_emitted, 1)


# ----------------------------------------------------------------------------------------------
# Losslessness: the emitted tokens are distributed as the target p, whatever the drafter does.

N, K, VOCAB = 20_000, 2, 5
ALPHA = 1e-3  # a correct sampler fails a check with probability 1e-3 (fixed seeds: never flaky)
ALL_DRAFTS = jnp.full(N, K, jnp.int32)
# The warped target comes from an independent float64 oracle (tests/test_sampling.warp_reference),
# not from warp_probs: temperature alone, and top-k and top-p each binding.
PARAM_CASES = [dict(temperature=1.0), dict(temperature=1.5, top_k=4, top_p=0.9), dict(temperature=0.6),
               dict(temperature=1.3, top_k=3), dict(temperature=0.8, top_p=0.75)]
CASE_IDS = ["plain", "warped", "cold", "top_k", "top_p"]


@functools.cache
def _distribution_setup(one_hot: bool, case: int):
    """N independent requests (request_id = row) verifying K drafts against fixed target logits.

    Returns logits [N, 1+K, V], drafts [N, K], draft_probs [N, K, V] or None, params, positions
    [N, 1+K], p [1+K, V] f64 (the warped target) and q_draw [K, V] f64 (what drafts were drawn from).
    """
    rng = np.random.default_rng(7)
    target = jnp.asarray(rng.normal(size=(1 + K, VOCAB)) * 1.5, jnp.float32)  # [1+K, V]
    logits = jnp.broadcast_to(target, (N, 1 + K, VOCAB))
    params = make_sampling_params(N, seed=2024, **PARAM_CASES[case])
    case_ = dict(temperature=1.0, top_k=0, top_p=1.0) | PARAM_CASES[case]
    p = np.stack([warp_reference(row, **case_) for row in np.asarray(target)])  # [1+K, V], every row's target
    if case_["top_k"] or case_["top_p"] < 1:  # the filter binds at every position
        assert all(0 < np.sum(pi > 0) < VOCAB for pi in p), p
    # A drafter that roughly agrees with the target: q = softmax(target logits + noise).
    q_draw = jax.nn.softmax(target[:K] + rng.normal(size=(K, VOCAB)) * 1.5)  # [K, V]
    # One-hot mode: the same sampled tokens, verified as if q were one-hot at them.
    draft_probs = None if one_hot else jnp.broadcast_to(q_draw, (N, K, VOCAB))
    drafts = categorical_rows(jax.random.key(8), jnp.broadcast_to(q_draw, (N, K, VOCAB)))
    q_draw = np.asarray(q_draw, np.float64)
    assert 0.5 * np.abs(q_draw - p[:K]).sum(-1).min() > 0.15  # the drafter clearly differs from p
    positions = jnp.broadcast_to(jnp.arange(30, 31 + K, dtype=jnp.int32), (N, 1 + K))
    return logits, drafts, draft_probs, params, positions, p, q_draw


def _chi_square_pvalue(tokens: np.ndarray, p: np.ndarray) -> float:
    """Goodness of fit of tokens [n] to probabilities p [V]; a zero-mass token gives p-value 0."""
    counts = np.bincount(tokens, minlength=len(p))
    if np.any(counts[p == 0] > 0):
        return 0.0
    support = p > 0
    if support.sum() == 1:  # a point mass, already matched exactly above
        return 1.0
    expected = p[support] / p[support].sum() * len(tokens)
    statistic = float(np.sum((counts[support] - expected) ** 2 / expected))
    return _chi2_sf(statistic, df=int(support.sum()) - 1)


def _chi2_sf(x: float, df: int) -> float:
    """P(chi2_df > x) = Q(df/2, x/2), the closed form for integer and half-integer shapes.

    Q(n, h) = e^-h sum_{i<n} h^i / i!;  Q(n + 1/2, h) = erfc(sqrt h) + e^-h sum_{i=1..n} h^(i-1/2) / G(i+1/2).
    """
    h = x / 2
    if df % 2 == 0:
        term = total = 1.0
        for i in range(1, df // 2):
            term *= h / i
            total += term
        return math.exp(-h) * total
    total, term = math.erfc(math.sqrt(h)), math.sqrt(h) / (math.sqrt(math.pi) / 2)
    for i in range(1, (df - 1) // 2 + 1):
        total += math.exp(-h) * term
        term *= h / (i + 0.5)
    return total


@pytest.mark.parametrize("one_hot", [False, True], ids=["q", "one_hot"])
@pytest.mark.parametrize("case", range(len(PARAM_CASES)), ids=CASE_IDS)
def test_emitted_tokens_follow_target(one_hot, case):
    logits, drafts, draft_probs, params, positions, p, q_draw = _distribution_setup(one_hot, case)
    tokens, num_emitted = verify_jit(logits, drafts, draft_probs, params, positions, ALL_DRAFTS)
    tokens, num_emitted = np.asarray(tokens), np.asarray(num_emitted)
    # Position i is emitted iff drafts 0..i-1 were accepted; that event uses only earlier
    # randomness, so conditioned on it the token at i must still be distributed as p_i
    # (i = 0: the marginal; i = 1: the second token given the first draft was kept; i = K: bonus).
    for i in range(1 + K):
        emitted = num_emitted > i
        assert emitted.sum() > 1000, (i, emitted.sum())  # enough samples for the test to bite
        pvalue = _chi_square_pvalue(tokens[emitted, i], p[i])
        assert pvalue > ALPHA, (i, pvalue)
    # Acceptance rate of draft 0: sum_x q_draw(x) min(1, p(x) / q(x)), with q = 1 for one-hot.
    q_declared = np.ones_like(q_draw[0]) if one_hot else q_draw[0]
    beta = np.sum(q_draw[0] * np.minimum(1.0, p[0] / q_declared))
    rate = np.mean(num_emitted > 1)
    assert abs(rate - beta) < 5 * np.sqrt(beta * (1 - beta) / N), (rate, beta)
    # Fixed seeds reproduce; another seed gives other draws.
    again, _ = verify_jit(logits, drafts, draft_probs, params, positions, ALL_DRAFTS)
    np.testing.assert_array_equal(tokens, again)
    reseeded = dataclasses.replace(params, seed=params.seed + 1)
    other, _ = verify_jit(logits, drafts, draft_probs, reseeded, positions, ALL_DRAFTS)
    assert np.any(tokens != np.asarray(other))


def test_exact_acceptance_edges():
    """q == p accepts every draft; a one-hot draft outside the target's support never is."""
    logits, _, _, _, positions, _, _ = _distribution_setup(False, 0)
    params = make_sampling_params(N, temperature=0.9, top_k=3, seed=5)  # same shapes, other values
    p = warp_jit(logits, params)
    drafts = categorical_rows(jax.random.key(6), p[:, :K])
    _, num_emitted = verify_jit(logits, drafts, p[:, :K], params, positions, ALL_DRAFTS)
    np.testing.assert_array_equal(num_emitted, 1 + K)
    outside = jnp.argmin(logits[:, :K], axis=-1).astype(jnp.int32)  # cut by top_k=3 of 5
    tokens, num_emitted = verify_jit(logits, outside, None, params, positions, ALL_DRAFTS)
    np.testing.assert_array_equal(num_emitted, 1)
    assert not np.any(np.asarray(tokens[:, 0]) == np.asarray(outside[:, 0]))


WRONG_SAMPLERS = ["always_accept", "resample_p_on_reject", "swapped_residual"]


@jax.jit
def _wrong_first_tokens(logits, drafts, q0, params, positions):
    """First emitted token [len(WRONG_SAMPLERS), N] under deliberately wrong verifiers of draft 0.

    q0: [N, V] the declared draft distribution at position 0 (one-hot rows for one-hot drafts).
    """
    p0 = warp_probs(logits[:, :1], params)[:, 0]  # [N, V]
    x0 = drafts[:, 0]
    p_x = jnp.take_along_axis(p0, x0[:, None], 1)[:, 0]
    q_x = jnp.take_along_axis(q0, x0[:, None], 1)[:, 0]
    accept_keys = token_key(params.seed, params.request_id, positions[:, 0], STREAM_ACCEPT)
    accept = jax.vmap(jax.random.uniform)(accept_keys) * q_x < p_x
    keys = token_key(params.seed, params.request_id, positions[:, 0], STREAM_RESIDUAL)

    def on_reject(residual):  # residual [N, V]
        return jnp.where(accept, x0, jax.vmap(categorical)(keys, residual))

    return jnp.stack([
        x0,  # always_accept: emits q, not p
        on_reject(p0),  # resample_p_on_reject: min(p, q) + (1 - beta) p != p
        on_reject(jnp.maximum(q0 - p0, 0.0)),  # swapped_residual: max(q - p, 0)
    ])


@pytest.mark.parametrize("one_hot", [False, True], ids=["q", "one_hot"])
def test_distribution_check_rejects_wrong_samplers(one_hot):
    """The statistical check above has power: each plausible bug fails it by a wide margin."""
    logits, drafts, draft_probs, params, positions, p, _ = _distribution_setup(one_hot, 0)
    q0 = jax.nn.one_hot(drafts[:, 0], VOCAB) if one_hot else draft_probs[:, 0]
    firsts = np.asarray(_wrong_first_tokens(logits, drafts, q0, params, positions))
    for kind, first in zip(WRONG_SAMPLERS, firsts, strict=True):
        assert _chi_square_pvalue(first, p[0]) < 1e-6, kind


def test_chi2_sf_matches_tables():
    """The 5% critical values from statistical tables for df = 1..4."""
    for df, critical in [(1, 3.841), (2, 5.991), (3, 7.815), (4, 9.488)]:
        assert abs(_chi2_sf(critical, df) - 0.05) < 1e-4
