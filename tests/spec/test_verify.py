"""Invariants of the rejection sampler: greedy semantics, zero drafts == sample, lossless output."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxspec.sampling import (
    STREAM_ACCEPT,
    STREAM_RESIDUAL,
    categorical,
    make_sampling_params,
    sample,
    token_key,
    warp_probs,
)
from jaxspec.spec.verify import rejection_sample

verify_jit = jax.jit(rejection_sample)
sample_jit = jax.jit(sample)
warp_jit = jax.jit(warp_probs)


@jax.jit
def categorical_rows(key, probs):
    """Independent draws from probs [R, k, V] -> [R, k] int32 (a drafter's own randomness)."""
    keys = jax.random.split(key, probs.shape[0] * probs.shape[1])
    flat = jax.vmap(categorical)(keys, probs.reshape(-1, probs.shape[-1]))
    return flat.reshape(probs.shape[:2])


def _peaked_logits(argmaxes, vocab):
    """[R, len, V] logits whose argmax at position i of row r is argmaxes[r][i]."""
    noise = jax.random.uniform(jax.random.key(0), (len(argmaxes), len(argmaxes[0]), vocab))
    return noise + 5.0 * jax.nn.one_hot(jnp.asarray(argmaxes), vocab)


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_greedy_acceptance(with_draft_probs):
    vocab, k = 6, 3
    target_argmax = [2, 4, 1, 5]  # target argmax at positions 0..3 for every row
    cases = [  # (drafts, num_drafts) -> (tokens, num_emitted)
        (([2, 4, 1], 3), ([2, 4, 1, 5], 4)),  # all accepted -> bonus = argmax at position 3
        (([2, 3, 1], 3), ([2, 4, 0, 0], 2)),  # first mismatch at 1 -> target argmax there
        (([0, 4, 1], 3), ([2, 0, 0, 0], 1)),  # mismatch at 0
        (([2, 4, 1], 2), ([2, 4, 1, 0], 3)),  # masked tail: bonus at position 2
        (([2, 4, 3], 2), ([2, 4, 1, 0], 3)),  # a wrong draft in the masked tail is ignored
        (([2, 4, 1], 0), ([2, 0, 0, 0], 1)),  # no drafts: plain greedy
    ]
    rows = len(cases)
    logits = _peaked_logits([target_argmax] * rows, vocab)
    drafts = jnp.asarray([c[0][0] for c in cases], jnp.int32)
    num_drafts = jnp.asarray([c[0][1] for c in cases], jnp.int32)
    draft_probs = None
    if with_draft_probs:  # greedy rows ignore q entirely
        draft_probs = jax.nn.softmax(jax.random.normal(jax.random.key(3), (rows, k, vocab)))
    params = make_sampling_params(rows, temperature=0.0, top_k=2, top_p=0.5, seed=11)
    positions = jnp.broadcast_to(jnp.arange(40, 44, dtype=jnp.int32), (rows, 1 + k))
    tokens, num_emitted = verify_jit(logits, drafts, draft_probs, params, positions, num_drafts)
    np.testing.assert_array_equal(tokens, [c[1][0] for c in cases])
    np.testing.assert_array_equal(num_emitted, [c[1][1] for c in cases])
    assert tokens.dtype == jnp.int32 and num_emitted.dtype == jnp.int32


def test_greedy_matches_sequential_reference():
    """Random drafts (half of them equal to the argmax): compare with a step-by-step loop."""
    rows, k, vocab = 64, 4, 7
    keys = jax.random.split(jax.random.key(4), 4)
    logits = jax.random.normal(keys[0], (rows, 1 + k, vocab))
    argmax = np.argmax(np.asarray(logits), -1)
    coin = np.asarray(jax.random.bernoulli(keys[1], 0.8, (rows, k)))
    random = np.asarray(jax.random.randint(keys[2], (rows, k), 0, vocab))
    drafts = np.where(coin, argmax[:, :k], random).astype(np.int32)
    num_drafts = np.asarray(jax.random.randint(keys[3], (rows,), 0, k + 1), np.int32)
    params = make_sampling_params(rows, temperature=0.0)
    positions = jnp.broadcast_to(jnp.arange(1 + k, dtype=jnp.int32), (rows, 1 + k))
    tokens, num_emitted = verify_jit(logits, drafts, None, params, positions, num_drafts)
    for r in range(rows):
        want = []
        for i in range(num_drafts[r] + 1):
            want.append(int(argmax[r, i]))
            if i == num_drafts[r] or drafts[r, i] != argmax[r, i]:
                break
        assert num_emitted[r] == len(want)
        np.testing.assert_array_equal(tokens[r], want + [0] * (1 + k - len(want)))


@pytest.mark.parametrize("k", [0, 3])
def test_zero_drafts_equals_plain_sample(k):
    rows, vocab = 8, 11
    logits = jax.random.normal(jax.random.key(5), (rows, 1 + k, vocab)) * 2
    params = make_sampling_params(
        rows, temperature=[0.0, 0.5, 1.0, 1.5] * 2, top_k=[0, 0, 3, 5] * 2,
        top_p=[1.0, 0.8, 1.0, 0.9, 1.0, 1.0, 0.5, 1.0], seed=list(range(rows)),
        request_id=[3, 1, 4, 1, 5, 9, 2, 6])
    positions = jnp.broadcast_to(jnp.arange(7, 8 + k, dtype=jnp.int32), (rows, 1 + k))
    drafts = jnp.ones((rows, k), jnp.int32)
    draft_probs = jnp.full((rows, k, vocab), 1.0 / vocab)
    for probs in (None, draft_probs):
        tokens, num_emitted = verify_jit(logits, drafts, probs, params, positions,
                                         jnp.zeros(rows, jnp.int32))
        plain = sample_jit(logits[:, :1], params, positions[:, :1])
        np.testing.assert_array_equal(tokens[:, :1], plain)
        np.testing.assert_array_equal(tokens[:, 1:], 0)
        np.testing.assert_array_equal(num_emitted, 1)


# ----------------------------------------------------------------------------------------------
# Losslessness: the emitted tokens are distributed as the target p, whatever the drafter does.

N, K, VOCAB = 20_000, 2, 5
ALPHA = 1e-3  # a correct sampler fails a check with probability 1e-3 (fixed seeds: never flaky)
ALL_DRAFTS = jnp.full(N, K, jnp.int32)
PARAM_CASES = [dict(temperature=1.0), dict(temperature=1.5, top_k=4, top_p=0.9)]


@functools.cache
def _distribution_setup(one_hot: bool, case: int):
    """N independent requests (request_id = row) verifying K drafts against fixed target logits.

    Returns logits [N, 1+K, V], drafts [N, K], draft_probs [N, K, V] or None, params, positions
    [N, 1+K], p [1+K, V] f64 (the warped target) and q_draw [K, V] f64 (what drafts were drawn from).
    """
    keys = jax.random.split(jax.random.key(7), 3)
    target = jax.random.normal(keys[0], (1 + K, VOCAB)) * 1.5  # [1+K, V]
    logits = jnp.broadcast_to(target, (N, 1 + K, VOCAB))
    params = make_sampling_params(N, seed=2024, **PARAM_CASES[case])
    p = np.asarray(warp_jit(logits, params)[0], np.float64)  # every row has the same target
    # A drafter that roughly agrees with the target: q = softmax(target logits + noise).
    q_draw = jax.nn.softmax(target[:K] + jax.random.normal(keys[2], (K, VOCAB)) * 1.5)  # [K, V]
    # One-hot mode: the same sampled tokens, verified as if q were one-hot at them.
    draft_probs = None if one_hot else jnp.broadcast_to(q_draw, (N, K, VOCAB))
    drafts = categorical_rows(keys[1], jnp.broadcast_to(q_draw, (N, K, VOCAB)))
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
    return stats.chisquare(counts[support], expected).pvalue


@pytest.mark.parametrize("one_hot", [False, True], ids=["q", "one_hot"])
@pytest.mark.parametrize("case", range(len(PARAM_CASES)), ids=["plain", "warped"])
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
