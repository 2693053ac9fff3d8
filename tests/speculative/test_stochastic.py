"""Speculative sampling (docs/speculation.md#stochastic-acceptance): fixed seeds reproduce exactly, whatever the batch;
and end to end, the token of the first speculative round follows the target's own sampling
distribution (chi-square on a tiny vocabulary), a check that deliberately wrong rejection samplers
fail. tests/speculative/test_verify.py tests the rejection sampler itself."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import jaxspec
from jaxspec import loop
from jaxspec.speculative import round as round_module
from jaxspec.speculative import verify
from tests.speculative.conftest import NEW_TOKENS, load
from tests.speculative.tap_checkpoints import write_dflash, write_eagle3
from tests.test_sampling import warp_reference

VOCAB = 12
N = 3000  # sampled requests per run
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
K = 2
ALPHA = 1e-3  # a correct sampler fails with probability 1e-3 (fixed seeds: never flaky)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_sampling_reproduces_across_runs_and_batches(family, method):
    fam = family("qwen3_5")
    spec = jaxspec.SpeculativeConfig(method, 3, draft_model=fam.draft if method == "draft_model" else None)
    options = dict(max_new_tokens=NEW_TOKENS, speculative=spec, temperature=0.8, top_p=0.95)
    seeds = list(range(100, 100 + len(fam.prompts)))
    first = jaxspec.generate(fam.batch, fam.prompts, seed=seeds, **options)
    assert 0 < first.stats.acceptance_rate < 1, first.stats.summary()
    assert jaxspec.generate(fam.batch, fam.prompts, seed=seeds, **options).token_ids == first.token_ids
    # keyed by (seed, request, position): one request at a time gives the same samples
    assert jaxspec.generate(fam.single, fam.prompts, seed=seeds, **options).token_ids == first.token_ids
    reseeded = jaxspec.generate(fam.batch, fam.prompts, seed=[s + 1 for s in seeds], **options)
    assert reseeded.token_ids != first.token_ids
    assert first.token_ids != fam.plain(fam.batch)


@pytest.fixture(scope="module")
def tiny(hf_checkpoint):
    """A 12-token vocabulary model without EOS ids (every request reaches its speculative round),
    running 64 requests per round."""
    model = load(hf_checkpoint("qwen3", vocab_size=VOCAB), max_num_seqs=64)
    model.request_buckets = (64,)
    model.config = model.config.replace(eos_token_ids=())
    return model


def _first_two(model, speculative=None) -> np.ndarray:
    """[N, 2]: the prefill token and the next one, at temperature 1, seeds 0..N-1."""
    result = jaxspec.generate(model, [PROMPT] * N, max_new_tokens=2, temperature=1.0, seed=list(range(N)),
                              speculative=speculative)
    return np.asarray(result.token_ids)


def _conditional_pvalue(pairs: np.ndarray, exact: dict[int, np.ndarray], min_dof: int = 21) -> float:
    """Chi-square test of the second token given the first: sum over first tokens t (with >= 100
    samples) of the goodness of fit of the second token to p(. | PROMPT, t); bins expecting fewer
    than 5 counts are merged; a token outside the support of p fails outright."""
    statistic, dof = 0.0, 0
    for t, p in exact.items():
        second = pairs[pairs[:, 0] == t, 1]
        if len(second) < 100:
            continue
        expected, observed = p * len(second), np.bincount(second, minlength=VOCAB)
        if observed[p == 0].any():
            return 0.0
        big = expected >= 5
        e = np.append(expected[big], expected[~big].sum())
        o = np.append(observed[big], observed[~big].sum())
        if e[-1] < 1e-9:
            e, o = e[:-1], o[:-1]
        statistic += float(np.sum((o - e) ** 2 / e))
        dof += len(e) - 1
    assert dof >= min_dof  # several first tokens, each with a spread-out second token
    return float(stats.chi2.sf(statistic, dof))


def _always_accept(target_logits, draft_tokens, draft_probs, params, positions, num_drafts, greedy=False):
    """Wrong: keeps every draft and adds the target argmax after them."""
    k = draft_tokens.shape[1]
    bonus = jnp.argmax(target_logits[:, k], axis=-1).astype(jnp.int32)
    return jnp.concatenate([draft_tokens, bonus[:, None]], axis=1), num_drafts + 1


@pytest.fixture(scope="module")
def plain_pairs(tiny):
    """(plain samples [N, 2], the exact distribution of the second token given each first token)."""
    plain = _first_two(tiny)
    exact = {int(t): np.asarray(jax.nn.softmax(jaxspec.score(tiny, PROMPT + [int(t)])[-1]), np.float64)
             for t in np.unique(plain[:, 0])}
    return plain, exact


def test_first_round_token_follows_target_distribution(tiny, plain_pairs, monkeypatch):
    plain, exact = plain_pairs
    assert _conditional_pvalue(plain, exact) > ALPHA  # the oracle: plain sampling follows `exact`

    ngram = jaxspec.SpeculativeConfig("ngram", K)
    result = jaxspec.generate(tiny, [PROMPT] * N, max_new_tokens=2, temperature=1.0, seed=list(range(N)),
                              speculative=ngram)
    spec = np.asarray(result.token_ids)
    assert np.array_equal(spec[:, 0], plain[:, 0])  # the prefill token uses the same keys
    assert 0.05 < result.stats.acceptance_rate < 0.95, result.stats.summary()
    assert _conditional_pvalue(spec, exact) > ALPHA

    # Deliberately wrong verifiers must fail the same test. The round is retraced for each
    # (round_executable's cache is bypassed), so the correct executable is never replaced.
    monkeypatch.setattr(loop, "round_executable", round_module._round_executable.__wrapped__)
    with monkeypatch.context() as wrong:
        wrong.setattr(round_module, "rejection_sample", _always_accept)
        assert _conditional_pvalue(_first_two(tiny, ngram), exact) < 1e-12
    with monkeypatch.context() as wrong:  # the classic bug: resample from p, not max(p - q, 0)
        wrong.setattr(verify, "_residual", lambda p_j, *_: p_j)
        assert _conditional_pvalue(_first_two(tiny, ngram), exact) < 1e-6


# Temperature 1.4 with top-k and top-p both binding at the first and second token (temperature alone
# is checked against the same oracle by test_sampling.py and test_verify.py). The oracle is
# tests/test_sampling.warp_reference (float64, HF's warper semantics) of jaxspec.score's logits,
# not warp_probs.
WARPED = {"top_k_top_p": dict(temperature=1.4, top_k=5, top_p=0.8)}


@pytest.mark.parametrize("case", sorted(WARPED))
def test_warped_first_round_token_follows_the_oracle(tiny, case):
    settings = dict(temperature=1.0, top_k=0, top_p=1.0) | WARPED[case]

    def oracle(tokens):
        return warp_reference(np.asarray(jaxspec.score(tiny, PROMPT + tokens)[-1]), **settings)

    first = oracle([])
    n = 2000
    result = jaxspec.generate(tiny, [PROMPT] * n, max_new_tokens=2, seed=list(range(n)),
                              speculative=jaxspec.SpeculativeConfig("ngram", K), **WARPED[case])
    pairs = np.asarray(result.token_ids)
    exact = {int(t): oracle([int(t)]) for t in np.unique(pairs[:, 0])}
    if settings["top_k"]:  # both filters bind: fewer tokens than top_k survive top-p somewhere
        assert all(np.sum(p > 0) <= settings["top_k"] for p in [first, *exact.values()])
        assert min(np.sum(p > 0) for p in [first, *exact.values()]) < settings["top_k"]
    assert 0.05 < result.stats.acceptance_rate < 0.95, result.stats.summary()
    counts = np.bincount(pairs[:, 0], minlength=VOCAB)  # the prefill token: a plain draw
    assert not counts[first == 0].any()
    assert stats.chisquare(counts[first > 0], first[first > 0] * n).pvalue > ALPHA
    assert _conditional_pvalue(pairs, exact, min_dof=8) > ALPHA  # the speculative round's token


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_tap_drafters_first_round_token_follows_target_distribution(tiny, plain_pairs, method, tmp_path):
    """EAGLE-3 and DFlash (random heads in their published layouts) draft from the target's taps;
    their first speculative round's token follows the target's distribution."""
    plain, exact = plain_pairs
    H = tiny.config.hidden_size
    head = write_eagle3(tmp_path, hidden=H, vocab=VOCAB, draft_vocab=VOCAB - 2, layer_ids=(0, 1, 1)) \
        if method == "eagle3" else write_dflash(tmp_path, hidden=H, vocab=VOCAB, target_layer_ids=(0, 1),
                                                mask_token_id=VOCAB - 1, block_size=K + 1)
    result = jaxspec.generate(tiny, [PROMPT] * N, max_new_tokens=2, temperature=1.0, seed=list(range(N)),
                              speculative=jaxspec.SpeculativeConfig(method, K, draft_model=head))
    pairs = np.asarray(result.token_ids)
    assert np.array_equal(pairs[:, 0], plain[:, 0])  # the prefill token (through the taps prefill) is a plain draw
    assert 50 < result.stats.accepted_by_position[0] < N - 50, result.stats.summary()  # both paths taken
    assert _conditional_pvalue(pairs, exact) > ALPHA
