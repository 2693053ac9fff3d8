"""jaxspec.measure: the replay cost model's expectations, and the measurement loop on a demo model
(replay at alpha 0 emits one token per round, at alpha 1 it emits 1 + k, and every alpha keeps the
greedy output)."""

from __future__ import annotations

import pytest

import jaxspec
from jaxspec import measure
from tests.demo_models import demo_model, prompts


@pytest.mark.parametrize("alpha,k,tau", [(0.0, 3, 1.0), (1.0, 3, 4.0), (0.5, 2, 1.75), (0.8, 1, 1.8)])
def test_expected_tau(alpha, k, tau):
    assert measure.expected_tau(alpha, k) == pytest.approx(tau)


def test_expected_tau_refuses_a_probability_outside_0_1():
    with pytest.raises(ValueError, match="alpha=1.5 must be in"):
        measure.expected_tau(1.5, 2)


def test_speedup_vs_alpha_on_the_demo():
    model, k = demo_model("qwen3"), 2
    prompt = prompts(lengths=(5,))
    rows = measure.speedup_vs_alpha(model, prompt, [0.0, 1.0], k=k, max_new_tokens=8, repeats=1)
    assert [r["alpha"] for r in rows] == [0.0, 1.0]
    assert rows[0]["tau"] == 1.0 and rows[1]["tau"] == 1.0 + k  # every draft rejected / accepted
    for row in rows:
        assert row["predicted"] == pytest.approx(row["tau"] / (1.0 + row["c"]))
        assert row["speedup"] > 0
    reference = measure.reference_tokens(model, prompt, max_new_tokens=8, k=k)
    plain = jaxspec.generate(model, prompt, max_new_tokens=8).token_ids
    assert reference[0][:8] == plain[0] and len(reference[0]) == 8 + k + 1
    timing = measure.time_generate(model, prompt, repeats=2, max_new_tokens=8,
                                   speculative=measure.replay(reference, k=k, alpha=0.5))
    assert len(timing.runs) == 2 and timing.result.token_ids == plain and timing.tokens_per_second > 0
