"""Greedy speculative decoding is token-identical to plain greedy decoding (docs/speculation.md#greedy-acceptance), for
every family, drafter and k; replay at alpha 1 / 0 gives tau = k + 1 / 1 exactly; pad_to_max
(masked draft tails) equals per-k.

Each (family, k, method) runs all prompts in one generate call on a 3-slot model (requests join
and leave between rounds, buckets 1 and 3) and on a 1-slot model. The full k matrix runs on the
dense family and the main hybrid; the MoE hybrids run k = 3 (compile budget on CPU), or every k
with JAXSPEC_TEST_FULL_MATRIX=1.
"""

from __future__ import annotations

import os

import jax
import pytest

import jaxspec
from tests.speculative.conftest import FAMILIES, K_MAX, NEW_TOKENS, load

FULL_MATRIX = FAMILIES if os.environ.get("JAXSPEC_TEST_FULL_MATRIX") else ("qwen3", "qwen3_5")
CASES = [(name, k) for name in FAMILIES for k in (1, 3, 7) if name in FULL_MATRIX or k == 3]


def _spec(fam, method: str, k: int, **options) -> jaxspec.SpeculativeConfig:
    if method == "draft_model":
        options["draft_model"] = fam.draft
    if method == "replay":
        options["replay_tokens"] = fam.reference
    return jaxspec.SpeculativeConfig(method, k, **options)


@pytest.fixture(scope="module")
def fam(request, family):
    """One family at a time: parametrizing through this module-scoped fixture groups the tests by
    family, and the family's executables are released before the next (see conftest.py)."""
    yield family(request.param)
    jax.clear_caches()


def _models(fam):
    return {"batch3": fam.batch, "batch1": fam.single}


def _check_parity(fam, model, spec) -> jaxspec.GenerateResult:
    result = jaxspec.generate(model, fam.prompts, max_new_tokens=NEW_TOKENS, speculative=spec)
    plain = fam.plain(model)
    for i, (got, want) in enumerate(zip(result.token_ids, plain, strict=True)):
        assert got == want, f"prompt {i} (length {len(fam.prompts[i])}): {got} != plain greedy {want}"
    stats = result.stats
    assert stats.verify_steps == sum(stats.emitted_histogram) > 0
    assert stats.drafted == spec.k * stats.verify_steps
    return result


@pytest.mark.parametrize("fam", ["qwen3_5"], indirect=True)
def test_plain_greedy_independent_of_batching(fam):
    """The references themselves: 3-slot waves, one request at a time and a longer run agree."""
    assert fam.plain(fam.batch) == fam.plain(fam.single)
    assert [r[:NEW_TOKENS] for r in fam.reference] == fam.plain(fam.batch)
    assert any(len(r) == NEW_TOKENS + K_MAX + 1 for r in fam.reference)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@pytest.mark.parametrize("fam,k", CASES, indirect=["fam"], scope="module")
def test_greedy_parity(fam, k, method):
    for label, model in _models(fam).items():
        result = _check_parity(fam, model, _spec(fam, method, k))
        if method == "draft_model":  # the draft disagrees sometimes: rollback paths ran
            assert 0 < result.stats.acceptance_rate < 1, (label, result.stats.summary())


@pytest.mark.parametrize("fam,k", CASES, indirect=["fam"], scope="module")
def test_replay_parity_and_tau(fam, k):
    """alpha 0: every draft is corrupted, so each round emits exactly one token (tau = 1).
    alpha 1: the drafts are the target's own greedy continuation, so every round emits k + 1
    tokens; only a request's last round is cut (by max_new_tokens or an EOS in the reference)."""
    for label, model in _models(fam).items():
        for alpha in (0.0, 0.5):
            stats = _check_parity(fam, model, _spec(fam, "replay", k, replay_alpha=alpha)).stats
            hist = stats.emitted_histogram
            assert len(hist) == k + 2 and hist[0] == 0
            if alpha == 0.0:
                assert hist[1] == stats.verify_steps and stats.tau == 1.0, (label, hist)
            else:
                assert 0 < stats.acceptance_rate < 1, (label, stats.summary())
        _check_full_rounds(fam, model, _spec(fam, "replay", k, replay_alpha=1.0))


def _check_full_rounds(fam, model, spec) -> None:
    """Streams the generation: each round's tokens arrive per request, so the k + 1 tokens of every
    uncut round are checked round by round (and the tokens against plain greedy)."""
    k, tokens, sizes = spec.k, {}, {}
    stream = jaxspec.generate(model, fam.prompts, max_new_tokens=NEW_TOKENS, speculative=spec, stream=True)
    for index, new in stream:
        tokens.setdefault(index, []).extend(new)
        sizes.setdefault(index, []).append(len(new))
    plain = fam.plain(model)
    assert [tokens[i] for i in range(len(plain))] == plain
    for i, got in sizes.items():
        n = len(plain[i]) - 1  # tokens produced by rounds (the first comes from prefill)
        want = [1] + [k + 1] * (n // (k + 1)) + ([n % (k + 1)] if n % (k + 1) else [])
        assert got == want, f"prompt {i}: tokens per round {got}, expected {want}"
    hist, rounds = stream.stats.emitted_histogram, sum(len(s) - 1 for s in sizes.values())
    last_rounds = sum(len(s) > 1 for s in sizes.values())  # may be cut by an EOS in the reference
    assert len(hist) == k + 2 and sum(hist) == rounds and hist[k + 1] >= rounds - last_rounds, hist


@pytest.mark.parametrize("method", ["ngram", "draft_model", "replay"])
@pytest.mark.parametrize("fam", ["qwen3_5"], indirect=True)
def test_pad_to_max_equals_per_k(fam, method):
    """k_mode="pad_to_max": every k runs the K_MAX executable with a masked draft tail; the output
    equals per-k (= plain greedy), and replay at alpha 1 still emits exactly k + 1 per round."""
    padded = load(fam.path, max_num_seqs=3, max_num_speculative_tokens=K_MAX, k_mode="pad_to_max")
    padded.request_buckets = fam.batch.request_buckets
    for k in (1, 3):
        spec = _spec(fam, method, k, replay_alpha=1.0)
        stats = _check_parity(fam, padded, spec).stats
        assert len(stats.emitted_histogram) == k + 2 and stats.drafted == k * stats.verify_steps
        if method == "replay":
            _check_full_rounds(fam, padded, spec)
