"""Serving more requests than the KV pool holds at once: admission by free pages, preemption of the
latest-admitted request when the pool runs dry (re-admitted later by recomputing its prompt plus
what it had returned), refusal of a request that can never fit, and page / slot accounting that is
whole after every call. Outputs must equal each request run alone, plain and with every drafter,
greedy and seeded sampling. Float32 on the trained demo pair.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest

import jaxspec
from jaxspec import cache
from tests.demo_models import assert_idle

PROMPTS = ["import os\nimport sys\n\n\n", "def __init__(self, name, value):\n    self.",
           "class Error(Exception):\n    \"\"\"", "        for i in range(len(", "if __name__ == '__main__':\n    "]
NEW_TOKENS = 40
SETTINGS = dict(dtype="float32", kernels="xla", max_model_len=96, max_num_seqs=2, prefill_chunk=8, page_size=4)
POOL = 1 + 14  # 56 positions: any one request fits (<= 13 + 40), two at full length do not


@functools.cache
def target(num_kv_pages: int | None = None, prefill_rows: int = 1, max_num_seqs: int = 2) -> jaxspec.Model:
    settings = dict(SETTINGS, max_num_seqs=max_num_seqs)
    model = jaxspec.load("demo", num_kv_pages=num_kv_pages, prefill_rows=prefill_rows, **settings)
    return dataclasses.replace(model, config=model.config.replace(eos_token_ids=()), _engines={})


@functools.cache
def draft() -> jaxspec.Model:
    return jaxspec.load("demo-draft", **SETTINGS)


def speculative(method):
    if method is None:
        return None
    if method == "draft_model":
        return jaxspec.SpeculativeConfig("draft_model", 3, draft_model=draft())
    return jaxspec.SpeculativeConfig(method, 3)


@functools.cache
def alone(method) -> tuple:
    """Each prompt generated alone with the full pool (the oracle)."""
    return tuple(tuple(jaxspec.generate(target(), [p], max_new_tokens=NEW_TOKENS, speculative=speculative(method))
                       .token_ids[0]) for p in PROMPTS)


@pytest.mark.parametrize("method", [None, "ngram", "draft_model", "mtp"])
def test_preempted_requests_finish_with_their_own_output(method):
    small = target(POOL)
    assert small.engine_config(3).total_pages == POOL
    result = jaxspec.generate(small, PROMPTS, max_new_tokens=NEW_TOKENS, speculative=speculative(method))
    assert result.stats.preemptions > 0, result.stats.summary()  # the pool really ran dry
    assert f"{result.stats.preemptions} preemptions" in result.stats.summary()
    assert tuple(map(tuple, result.token_ids)) == alone(method)
    assert_idle(small)


@pytest.mark.parametrize("method", [None, "draft_model", "mtp"])
def test_admission_waves_prefill_two_prompts_per_call(method):
    """prefill_rows=2: the requests admitted together prefill in shared calls (padded with null
    rows when one prompt runs out), through preemption and re-admission too; every output equals
    the request alone. MTP consumes each prompt's hidden states, so it prefills one per call."""
    model = target(POOL, prefill_rows=2)
    result = jaxspec.generate(model, PROMPTS, max_new_tokens=NEW_TOKENS, speculative=speculative(method))
    assert tuple(map(tuple, result.token_ids)) == alone(method)
    one_per_call = jaxspec.generate(target(POOL), PROMPTS[:2], max_new_tokens=1).stats.prefill_steps
    two_per_call = jaxspec.generate(model, PROMPTS[:2], max_new_tokens=1,
                                    speculative=speculative(method)).stats.prefill_steps
    assert (two_per_call == one_per_call) if method == "mtp" else (two_per_call < one_per_call)
    assert_idle(model)


def test_a_wave_of_admissions_has_the_pages_its_drafter_writes():
    """Three 8-token prompts (page boundaries) admitted in one wave with MTP at k 3: the drafter's
    admission drafts k positions past each prompt, a page the prompt does not need. The pool (8
    pages) fits each prompt plus one dispatch but not all three requests at once: admission must
    take those pages before the prefill (the third request waits) instead of the pool running dry
    inside it. Every output equals the request alone."""
    prompts = [list(range(300 + 20 * i, 308 + 20 * i)) for i in range(3)]
    spec = jaxspec.SpeculativeConfig("mtp", 3)
    small = target(1 + 8, max_num_seqs=3)
    result = jaxspec.generate(small, prompts, max_new_tokens=16, speculative=spec)
    assert result.token_ids == [jaxspec.generate(target(), [p], max_new_tokens=16, speculative=spec).token_ids[0]
                                for p in prompts]
    assert_idle(small)


def test_prefill_calls_take_the_smallest_row_bucket(monkeypatch):
    """prefill_rows=3: executables of 1, 2 and 3 rows; a wave of two prompts, and the longest
    prompt's last chunks once the others are done, run the 2- and 1-row buckets (compiled by
    precompile: nothing compiles in generate), and outputs equal each request alone."""
    from jaxspec import compile as jc
    from jaxspec.config import prefill_row_buckets

    assert [prefill_row_buckets(n) for n in (1, 2, 3, 6, 8)] == [(1,), (1, 2), (1, 2, 3), (1, 2, 4, 6), (1, 2, 4, 8)]
    model = target(prefill_rows=3, max_num_seqs=3)
    table = jc.bucket_table(model, methods=(), sampling=("greedy",))
    assert [b.num_reqs for b in table if b.name == "prefill"] == [1, 2, 3]
    jc.precompile(model, table, progress=False)
    prompts = [PROMPTS[0], PROMPTS[1] * 3, PROMPTS[3]]  # 13 / 40 tokens...: the long one ends alone
    from jaxspec import engine as engine_module

    widths, device_int32 = [], engine_module._device_int32  # prefill_many sends each call's [rows] metadata

    def spy(values, mesh):
        widths.append(len(values))
        return device_int32(values, mesh)

    monkeypatch.setattr(engine_module, "_device_int32", spy)
    with jc.count_compiles() as count:
        two = jaxspec.generate(model, prompts[:2], max_new_tokens=8)
        assert 2 in widths and 3 not in widths, widths
        three = jaxspec.generate(model, prompts, max_new_tokens=8)
        assert 3 in widths, widths
    assert count.traces == 0 and count.backend_compiles == 0, count  # precompile's own executables, in memory
    want = [jaxspec.generate(target(), [p], max_new_tokens=8).token_ids[0] for p in prompts]
    assert two.token_ids == want[:2] and three.token_ids == want
    assert three.stats.prefill_steps < sum(-(-len(ids) // SETTINGS["prefill_chunk"]) for ids in
                                           (model.tokenizer.encode(p) for p in prompts))
    assert_idle(model)


def test_prefill_rows_auto_is_up_to_eight_requests():
    from jaxspec import cli

    for seqs, rows in ((3, 3), (16, 8)):
        model = jaxspec.load("demo:qwen3", cache_dir=None, max_model_len=32, max_num_seqs=seqs)
        assert model.prefill_rows == rows
    parse = cli._auto_or_positive("prefill-rows")
    assert parse("auto") == "auto" and parse("3") == 3


def test_bad_prefill_rows_is_refused_before_loading():
    for value, message in ((0, "prefill_rows=0 must be .auto. or an integer in 1..max_num_seqs=2"),
                           (3, "prefill_rows=3 must be"), (True, "prefill_rows=True")):
        with pytest.raises(ValueError, match=message):
            jaxspec.load("demo", prefill_rows=value, **SETTINGS)


def test_preemption_keeps_seeded_sampling():
    small = target(POOL)
    result = jaxspec.generate(small, PROMPTS, max_new_tokens=NEW_TOKENS, temperature=0.9, top_k=50, seed=7)
    assert result.stats.preemptions > 0
    # randomness is keyed by (seed, request index, position): the same call on the full pool, where
    # nothing is preempted, is the oracle
    want = jaxspec.generate(target(), PROMPTS, max_new_tokens=NEW_TOKENS, temperature=0.9, top_k=50, seed=7)
    assert want.stats.preemptions == 0 and result.token_ids == want.token_ids
    assert_idle(small)


def test_a_request_that_can_never_fit_is_refused_and_the_pool_stays_whole():
    small = target(POOL)
    before = jaxspec.generate(small, PROMPTS[:2], max_new_tokens=8).token_ids  # computed first
    with pytest.raises(ValueError, match=r"prompts\[1\] needs 40 \+ max_new_tokens=40 = 80 KV positions but the "
                                         r"whole pool holds 56 \(14 pages of 4\)"):
        jaxspec.generate(small, [[5] * 10, list(range(100, 140))], max_new_tokens=40)
    assert_idle(small)
    assert jaxspec.generate(small, PROMPTS[:2], max_new_tokens=8).token_ids == before


def test_pages_and_slots_are_whole_after_closed_streams_and_errors():
    small = target(POOL)
    stream = jaxspec.generate(small, PROMPTS, max_new_tokens=NEW_TOKENS, stream=True)
    for i, _ in enumerate(stream):
        if i == 12:
            break
    stream.close()
    assert_idle(small)
    with pytest.raises(ValueError):
        jaxspec.generate(small, PROMPTS, max_new_tokens=NEW_TOKENS, temperature=-1.0)
    assert_idle(small)


def test_pool_is_sized_from_the_memory_budget():
    base = target()
    ecfg = base.engine_config(0)
    assert ecfg.total_pages == 1 + ecfg.max_num_seqs * ecfg.pages_per_seq  # no budget on CPU: the maximum
    fixed = cache.params_bytes(base.params) + sum(v for k, v in cache.cache_bytes(base.config, ecfg, base.dtype).items()
                                                  if k != "kv_pages")
    per_page = cache.page_bytes(base.config, ecfg, base.dtype, len(base.params["mtp"]["layers"]))
    budget = int((fixed + 20.5 * per_page) / (1 - cache.POOL_HEADROOM))
    sized = dataclasses.replace(base, memory_budget=budget, _engines={})
    assert sized.engine_config(0).total_pages == 20
    assert dataclasses.replace(base, num_kv_pages=9, _engines={}).engine_config(0).total_pages == 9


@pytest.mark.parametrize("value", [0, 1, 2.5, "many"])
def test_bad_num_kv_pages_is_refused(value):
    with pytest.raises(ValueError, match="num_kv_pages"):
        jaxspec.load("demo:qwen3", cache_dir=None, max_model_len=32, num_kv_pages=value)
