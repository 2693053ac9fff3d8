"""Measurement helpers for notebooks and benchmarks: warm, repeated generate timings (compile time
excluded, median of the runs), the replay drafter's reference continuations, and the speedup model.

Cost model. A plain decode step costs t_d. A speculative round (draft + verify of 1+k tokens +
accept) costs t_r = (1 + c) * t_d and emits tau tokens on average (bonus included), so generating
N tokens takes N/tau rounds instead of N steps:

    speedup = (N * t_d) / ((N / tau) * (1 + c) * t_d) = tau / (1 + c)

The replay drafter measures both terms. At replay_alpha = 0 every draft is rejected, every round
emits exactly one token, and the run takes as many rounds as plain decoding takes steps, so
c = T_replay(alpha=0) / T_plain - 1, with T the decode phase (a call's time minus the time of the
same call generating one token: prefill and admission). At alpha each draft token survives with probability alpha, so
draft i (1-based) is accepted with probability alpha^i and the expected tokens per round is
tau(alpha, k) = 1 + alpha + ... + alpha^k = (1 - alpha^(k+1)) / (1 - alpha).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from jaxspec.generate import GenerateResult, generate
from jaxspec.speculative.config import SpeculativeConfig


@dataclass
class Timing:
    """Wall times of repeated, identical generate calls after one warm-up call."""

    result: GenerateResult  # the last timed call
    runs: list[float]  # seconds of each timed call

    @property
    def seconds(self) -> float:
        return statistics.median(self.runs)

    @property
    def tokens_per_second(self) -> float:
        return self.result.stats.tokens / self.seconds


def time_generate(model, prompts, *, repeats: int = 3, **generate_kwargs) -> Timing:
    """Call generate once to compile (not timed), then `repeats` times; returns every wall time."""
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"{repeats=} must be an integer >= 1")
    generate(model, prompts, **generate_kwargs)
    runs = [_timed_call(model, prompts, **generate_kwargs) for _ in range(repeats)]
    return Timing(runs[-1][1], [seconds for seconds, _ in runs])


def _timed_call(model, prompts, **generate_kwargs) -> tuple[float, GenerateResult]:
    start = time.perf_counter()
    result = generate(model, prompts, **generate_kwargs)
    return time.perf_counter() - start, result


def reference_tokens(model, prompts, *, max_new_tokens: int, k: int) -> list[list[int]]:
    """The target's greedy continuation of each prompt, k + 1 tokens longer than the generation so
    that the replay drafter always has k tokens to propose."""
    return generate(model, prompts, max_new_tokens=max_new_tokens + k + 1).token_ids


def replay(reference: list[list[int]], *, k: int, alpha: float, seed: int = 0) -> SpeculativeConfig:
    """A replay SpeculativeConfig proposing `reference` with per-token acceptance alpha."""
    return SpeculativeConfig("replay", k, replay_tokens=reference, replay_alpha=float(alpha), replay_seed=seed)


def expected_tau(alpha: float, k: int) -> float:
    """Expected tokens per round when each of k drafts survives with probability alpha:
    (1 - alpha^(k+1)) / (1 - alpha), and k + 1 at alpha = 1."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"{alpha=} must be in [0, 1]")
    return float(k + 1) if alpha == 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def paired_speedup(model, prompts, speculative, *, max_new_tokens: int, repeats: int = 5,
                   **generate_kwargs) -> tuple[float, GenerateResult]:
    """Decode-phase speedup of `speculative` over plain decoding: the median over `repeats` pairs of
    T_plain / T_speculative, where T is a call's time minus the time of the same call with
    max_new_tokens=1 (prefill and admission, the same work on both sides, which the model
    tau / (1 + c) leaves out). The calls of a pair run back to back, so drift in machine load
    cancels; every call is warm. Returns (speedup, the last speculative result)."""
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"{repeats=} must be an integer >= 1")
    sides = [dict(generate_kwargs), dict(generate_kwargs, speculative=speculative)]
    for kwargs in sides:  # warm up: compile everything both sides use
        generate(model, prompts, max_new_tokens=max_new_tokens, **kwargs)
        generate(model, prompts, max_new_tokens=1, **kwargs)
    ratios = []
    for _ in range(repeats):
        decode_seconds = []
        for kwargs in sides:
            total, result = _timed_call(model, prompts, max_new_tokens=max_new_tokens, **kwargs)
            start_up, _ = _timed_call(model, prompts, max_new_tokens=1, **kwargs)
            decode_seconds.append(max(total - start_up, 1e-9))
        ratios.append(decode_seconds[0] / decode_seconds[1])
    return statistics.median(ratios), result


def speedup_vs_alpha(model, prompts, alphas, *, k: int, max_new_tokens: int, repeats: int = 5) -> list[dict]:
    """Measured speedup of the replay drafter over plain greedy decoding for each alpha, against the
    model tau / (1 + c), with c measured at alpha = 0 (see the module docstring). Paired runs in one
    process on the same engine, medians of `repeats` warm pairs. One dict per alpha with keys alpha,
    tau (measured), expected_tau, speedup (measured), predicted (tau / (1 + c)) and c."""
    reference = reference_tokens(model, prompts, max_new_tokens=max_new_tokens, k=k)
    at_zero, _ = paired_speedup(model, prompts, replay(reference, k=k, alpha=0.0), repeats=repeats,
                                max_new_tokens=max_new_tokens)
    c = 1.0 / at_zero - 1.0  # a round costs 1 + c plain steps
    rows = []
    for alpha in alphas:
        speedup, result = paired_speedup(model, prompts, replay(reference, k=k, alpha=alpha), repeats=repeats,
                                         max_new_tokens=max_new_tokens)
        tau = result.stats.tau
        rows.append(dict(alpha=float(alpha), tau=tau, expected_tau=expected_tau(alpha, k), speedup=speedup,
                         predicted=tau / (1.0 + c), c=c))
    return rows


def forget_compiled() -> None:
    """Drop every executable this process has compiled or loaded (jax.clear_caches), so the next
    call compiles as a fresh process would: from the persistent cache when the executable is there."""
    import jax

    jax.clear_caches()
