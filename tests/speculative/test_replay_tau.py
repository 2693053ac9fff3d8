"""The replay drafter's measured acceptance against its expectation at 0 < alpha < 1 (the benchmarks'
speedup model tau / (1 + c) rests on it; the parity tests check alpha 0 and 1 only).

With the target's own greedy continuation as reference, an uncorrupted draft is always accepted and
a corrupted one never, and each position is corrupted independently with probability 1 - alpha
(keyed by seed, request and position). A round drafting positions s+1 .. s+k accepts the run of
uncorrupted drafts, a = min(G, k) with P(G >= i) = alpha^i, emits 1 + a tokens, and the next round
starts past the first corrupted position it looked at, so rounds are independent. Hence
    E[tau] = 1 + E[a] = sum_{i=0..k} alpha^i = (1 - alpha^(k+1)) / (1 - alpha),
    P(draft i accepted) = alpha^(i+1),
and over n rounds the estimates have binomial / sample-mean standard errors, which set the
tolerances (4 standard errors: a correct drafter fails with probability < 1e-4 per check, and the
seeds are fixed, so never flaky). A request ending by max_new_tokens is a stopping time: pooled
over rounds, emitted / rounds is the ratio of sums that Wald's identity makes unbiased.
"""

from __future__ import annotations

import numpy as np
import pytest

import jaxspec
from jaxspec import measure
from tests.speculative.conftest import K_MAX, NEW_TOKENS

K = 3
SEEDS = range(6)


def accepted_distribution(alpha: float, k: int) -> np.ndarray:
    """P(a = j), j = 0..k: the truncated geometric run of uncorrupted drafts."""
    return np.array([alpha ** j * (1 - alpha) for j in range(k)] + [alpha ** k])


@pytest.mark.parametrize("alpha", [0.5, 0.8])
def test_replay_tau_matches_its_expectation(family, alpha):
    fam = family("qwen3")
    full = [i for i, r in enumerate(fam.reference) if len(r) == NEW_TOKENS + K_MAX + 1]  # no EOS
    prompts, reference = [fam.prompts[i] for i in full], [fam.reference[i] for i in full]
    accepted, rounds, by_position = 0, 0, np.zeros(K)
    for seed in SEEDS:
        spec = jaxspec.SpeculativeConfig("replay", K, replay_tokens=reference, replay_alpha=alpha, replay_seed=seed)
        result = jaxspec.generate(fam.batch, prompts, max_new_tokens=NEW_TOKENS, speculative=spec)
        assert result.token_ids == [r[:NEW_TOKENS] for r in reference]
        stats = result.stats
        accepted, rounds = accepted + stats.accepted, rounds + stats.verify_steps
        by_position += stats.accepted_by_position
        assert stats.drafted_by_position == [stats.verify_steps] * K
    dist = accepted_distribution(alpha, K)
    mean_a = float(np.arange(K + 1) @ dist)
    assert 1 + mean_a == pytest.approx(measure.expected_tau(alpha, K))  # (1 - alpha^(k+1)) / (1 - alpha)
    sd_a = float(np.sqrt(np.arange(K + 1) ** 2 @ dist - mean_a ** 2))
    tau = (accepted + rounds) / rounds
    assert rounds > 500
    assert abs(tau - (1 + mean_a)) < 4 * sd_a / np.sqrt(rounds), (tau, 1 + mean_a, rounds)
    for i in range(K):
        p = alpha ** (i + 1)
        assert abs(by_position[i] / rounds - p) < 4 * np.sqrt(p * (1 - p) / rounds), (i, by_position[i] / rounds, p)
