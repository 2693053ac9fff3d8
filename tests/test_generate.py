"""jaxspec.generate behaviour on demo models: refusals leave the model usable, batching (and waves
of continuous batching) equals one-at-a-time generation, early stops, seeded sampling, streaming."""

from __future__ import annotations

import dataclasses

import pytest

import jaxspec
from tests.demo_models import NEW_TOKENS, assert_idle, demo_model, one_at_a_time, prompts

FAMILIES = ("qwen3", "qwen3_5")  # dense attention and hybrid GDN
SAMPLED = dict(temperature=0.8, top_k=40, top_p=0.9, max_new_tokens=NEW_TOKENS)


def truncate_at(tokens: list[int], stop: set[int]) -> list[int]:
    """tokens up to and including the first stop id."""
    for i, t in enumerate(tokens):
        if t in stop:
            return tokens[:i + 1]
    return tokens


# ---- refusals ----------------------------------------------------------------------------------

TOO_LONG = [1] * 60  # 60 + 8 new tokens > max_model_len 64

REFUSALS = {
    "empty str": (dict(prompts=""), r"prompts\[0\] is empty"),
    "empty ids": (dict(prompts=[[5], []]), r"prompts\[1\] is empty"),
    "no prompts": (dict(prompts=[]), "non-empty list"),
    "bad prompt type": (dict(prompts=[3.5]), r"prompts\[0\]=3.5 must be a str or a list of int"),
    "id >= vocab": (dict(prompts=[[1, 384]]), r"token id 384 outside \[0, 384\)"),
    "negative id": (dict(prompts=[[-1]]), r"token id -1 outside \[0, 384\)"),
    "too long": (dict(prompts=[[1], TOO_LONG]), r"prompts\[1\] has 60 tokens.*max_model_len=64"),
    "max_new_tokens 0": (dict(max_new_tokens=0), "max_new_tokens=0 must be an integer >= 1"),
    "max_new_tokens float": (dict(max_new_tokens=2.0), "max_new_tokens=2.0 must be an integer >= 1"),
    "temperature < 0": (dict(temperature=-0.5), r"temperature=-0.5 must be a finite number >= 0"),
    "temperature nan": (dict(temperature=float("nan")), "temperature=nan must be"),
    "top_p 0": (dict(top_p=0.0), r"top_p=0.0 must be in \(0, 1\]"),
    "top_p > 1": (dict(top_p=1.5), r"top_p=1.5 must be in \(0, 1\]"),
    "top_k < 0": (dict(top_k=-1), "top_k=-1 must be an integer >= 0"),
    "seed < 0": (dict(seed=-1), r"seed=-1 must be an integer in \[0, 2\*\*32\)"),
    "seed list length": (dict(seed=[1]), "seed has 1 entries for 2 prompts"),
    "stop id type": (dict(stop_token_ids=["x"]), "stop_token_ids.*'x'"),
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_bad_input_is_refused_and_generation_still_works(case, stream):
    """Every refusal happens at call time (also for stream=True), names the value, and leaves the
    model producing exactly what it produced before."""
    model = demo_model("qwen3")
    good = dict(prompts=prompts()[:2], max_new_tokens=NEW_TOKENS)
    before = one_at_a_time("qwen3")[:2]  # computed before the refused call, also when this test runs first
    kwargs, message = REFUSALS[case]
    with pytest.raises(ValueError, match=message):
        jaxspec.generate(model, **{**good, **kwargs, "stream": stream})
    assert_idle(model)
    assert jaxspec.generate(model, **good).token_ids == before


@pytest.mark.parametrize("tokens,message", [([], "is empty"), ([0, 400], r"token id 400 outside \[0, 384\)"),
                                            ([1] * 65, "65 tokens exceed max_model_len=64")])
def test_bad_score_input_is_refused(tokens, message):
    model = demo_model("qwen3")
    with pytest.raises(ValueError, match=message):
        jaxspec.score(model, tokens)
    assert_idle(model)


# ---- batching and continuous batching ----------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_batched_equals_one_at_a_time(family):
    """Five prompts of lengths 1..35 through two slots: requests join and leave between steps."""
    model = demo_model(family)
    result = jaxspec.generate(model, prompts(), max_new_tokens=NEW_TOKENS)
    assert result.token_ids == one_at_a_time(family)
    assert result.finish_reasons == ["length"] * 5
    assert result.stats.num_prompts == 5 and result.stats.tokens == 5 * NEW_TOKENS
    assert result.texts == [model.tokenizer.decode(t) for t in result.token_ids]
    assert_idle(model)


def early_stop(alone: list[list[int]]) -> tuple[int, int]:
    """(early, stop): the second token of first-wave request `early` (0 or 1), absent from its first
    token and from the other first-wave request, so that only `early` stops after two tokens."""
    for early in (0, 1):
        stop = alone[early][1]
        if stop != alone[early][0] and stop not in alone[1 - early]:
            return early, stop
    raise AssertionError(f"no usable stop id in {alone[:2]}")


@pytest.mark.parametrize("family", FAMILIES)
def test_early_stop_frees_its_slot_and_leaves_the_others_unchanged(family):
    """A stop id ends one first-wave request after two tokens; its slot goes to a waiting request
    while the other first-wave request still runs, and every output equals its one-at-a-time
    continuation cut at the same id."""
    model = demo_model(family)
    alone = one_at_a_time(family)
    early, stop = early_stop(alone)
    events = list(jaxspec.generate(model, prompts(), max_new_tokens=NEW_TOKENS, stop_token_ids=[stop], stream=True))
    order = [i for i, _ in events]
    other_ends = len(order) - 1 - order[::-1].index(1 - early)
    assert order.index(2) < other_ends  # request 2 took the freed slot while the other still ran
    result = jaxspec.generate(model, prompts(), max_new_tokens=NEW_TOKENS, stop_token_ids=[stop])
    expected = [truncate_at(a, {stop}) for a in alone]
    assert result.token_ids == expected and len(expected[early]) == 2
    assert result.finish_reasons == ["stop" if len(e) < NEW_TOKENS else "length" for e in expected]
    assert_idle(model)


def test_smaller_max_new_tokens_gives_prefixes():
    model = demo_model("qwen3_5")
    result = jaxspec.generate(model, prompts(), max_new_tokens=3)
    assert result.token_ids == [a[:3] for a in one_at_a_time("qwen3_5")]
    assert_idle(model)


def test_eos_ends_a_request():
    """The model's own EOS id (257 for demo models) stops a request like a stop id does."""
    model = demo_model("qwen3")
    alone = one_at_a_time("qwen3")[:2]
    eos = alone[1][2]
    eos_model = dataclasses.replace(model, config=model.config.replace(eos_token_ids=(eos,)))  # same engine
    result = jaxspec.generate(eos_model, prompts()[:2], max_new_tokens=NEW_TOKENS)
    assert result.token_ids == [truncate_at(a, {eos}) for a in alone] and len(result.token_ids[1]) <= 3
    assert result.finish_reasons[1] == "stop"


# ---- seeded sampling -----------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_fixed_seed_reproduces_sampling_in_any_batch(family):
    """Random numbers are keyed by (seed, request index, position): the prompt at index 2 samples the
    same tokens whatever its batch-mates; other seeds give other samples."""
    model = demo_model(family)
    ps, others = prompts(), prompts(seed=5)
    a = jaxspec.generate(model, ps, seed=7, **SAMPLED).token_ids
    assert jaxspec.generate(model, ps, seed=7, **SAMPLED).token_ids == a
    mixed = jaxspec.generate(model, [others[0], others[3], ps[2]], seed=7, **SAMPLED).token_ids
    assert mixed[2] == a[2]
    b = jaxspec.generate(model, ps, seed=8, **SAMPLED).token_ids
    assert all(x != y for x, y in zip(a, b, strict=True))
    assert a != one_at_a_time(family)  # sampling is on
    assert_idle(model)


def test_seed_list_gives_each_prompt_its_own_seed():
    model = demo_model("qwen3")
    ps = prompts()[:4]
    by_seed = {s: jaxspec.generate(model, ps, seed=s, **SAMPLED).token_ids for s in (3, 4)}
    mixed = jaxspec.generate(model, ps, seed=[3, 4, 4, 3], **SAMPLED).token_ids
    assert mixed == [by_seed[3][0], by_seed[4][1], by_seed[4][2], by_seed[3][3]]


# ---- streaming ---------------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_stream_concatenation_equals_result(family):
    model = demo_model(family)
    stream = jaxspec.generate(model, prompts(), max_new_tokens=NEW_TOKENS, stream=True)
    per_request: dict[int, list[int]] = {}
    for index, new in stream:
        assert new and all(isinstance(t, int) for t in new)
        per_request.setdefault(index, []).extend(new)
    assert [per_request[i] for i in range(5)] == one_at_a_time(family)
    assert stream.stats.tokens == 5 * NEW_TOKENS
    assert_idle(model)


def test_closing_a_stream_frees_its_slots():
    model = demo_model("qwen3_5")
    before = one_at_a_time("qwen3_5")  # computed before the stream, also when this test runs first
    stream = jaxspec.generate(model, prompts(), max_new_tokens=NEW_TOKENS, stream=True)
    next(stream), next(stream), next(stream)
    assert len(model.engine().free_slots) < model.max_num_seqs  # mid-generation
    stream.close()
    assert_idle(model)
    assert list(stream) == []
    assert jaxspec.generate(model, prompts(), max_new_tokens=NEW_TOKENS).token_ids == before


def test_abandoned_stream_does_not_block_the_next_call():
    """A stream left half-read (still referenced, as in a notebook cell) holds every slot; the next
    generate on the model ends it instead of waiting forever for a slot."""
    model = demo_model("qwen3")
    before = one_at_a_time("qwen3")  # computed before the stream, also when this test runs first
    stream = jaxspec.generate(model, prompts(), max_new_tokens=NEW_TOKENS, stream=True)
    next(stream), next(stream)
    assert not model.engine().free_slots
    assert jaxspec.generate(model, prompts(), max_new_tokens=NEW_TOKENS).token_ids == before
    assert_idle(model)
    with pytest.raises(RuntimeError, match="ended .* by a later generate or score call"):
        next(stream)  # reading on says why the stream ended, instead of silently stopping


def collect(stream) -> list[list[int]]:
    per_request: dict[int, list[int]] = {}
    for index, new in stream:
        per_request.setdefault(index, []).extend(new)
    return [per_request[i] for i in sorted(per_request)]


def test_score_ends_an_abandoned_stream_but_not_an_unstarted_one():
    """A half-read stream is ended by score as by generate; a stream not yet started holds no slot
    and runs normally afterwards."""
    model = demo_model("qwen3_5")
    unstarted = jaxspec.generate(model, prompts()[:3], max_new_tokens=NEW_TOKENS, stream=True)
    half_read = jaxspec.generate(model, prompts(), max_new_tokens=NEW_TOKENS, stream=True)
    next(half_read), next(half_read)
    assert not model.engine().free_slots
    assert jaxspec.score(model, prompts()[1]).shape == (15, model.config.vocab_size)
    with pytest.raises(RuntimeError, match="ended"):
        next(half_read)
    assert collect(unstarted) == one_at_a_time("qwen3_5")[:3]
    assert_idle(model)
