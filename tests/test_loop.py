"""The generation loop (jaxspec/loop.py) keeps the host out of the device's way without changing a
token: with dispatches read back one or two behind (dispatch_ahead) and several rounds per dispatch
(rounds_per_dispatch), every output equals the synchronous reference (dispatch_ahead 0, one round
per dispatch), for plain decoding and every drafter, with waves of requests admitted while others
run, stop ids that fall inside accepted draft blocks, max_new_tokens reached mid-block, streams
reassembled in order and streams closed early. Float32 on the trained demo pair, so drafts are
accepted in blocks.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest

import jaxspec
from tests.demo_models import assert_idle

PROMPTS = ["import os\nimport sys\n\n\n", "def __init__(self, name, value):\n    self.",
           "class Error(Exception):\n    \"\"\"", "        for i in range(len(", "if __name__ == '__main__':\n    "]
NEW_TOKENS = 13  # not a multiple of 1 + k: the last round of most requests is cut by max_new_tokens
SETTINGS = dict(dtype="float32", kernels="xla", max_model_len=96, max_num_seqs=2, prefill_chunk=8, page_size=4)
SYNC = dict(dispatch_ahead=0, rounds_per_dispatch=1)
LOOPS = [dict(dispatch_ahead=1, rounds_per_dispatch=1), dict(dispatch_ahead=2, rounds_per_dispatch=1),
         dict(dispatch_ahead=1, rounds_per_dispatch=3)]


@functools.cache
def target() -> jaxspec.Model:
    """The trained demo without EOS (stops come from stop_token_ids and max_new_tokens only)."""
    model = jaxspec.load("demo", **SETTINGS)
    return dataclasses.replace(model, config=model.config.replace(eos_token_ids=()), _engines={})


@functools.cache
def draft() -> jaxspec.Model:
    return jaxspec.load("demo-draft", **SETTINGS)


def speculative(method: str | None):
    if method is None:
        return None
    if method == "draft_model":
        return jaxspec.SpeculativeConfig("draft_model", 3, draft_model=draft())
    if method == "replay":  # the plain greedy continuation, so whole blocks are accepted
        return jaxspec.SpeculativeConfig("replay", 3, replay_tokens=reference(None, ()).token_ids, replay_alpha=0.9)
    return jaxspec.SpeculativeConfig(method, 3)


def run(loop: dict, method, stop_ids=(), **kwargs):
    model = dataclasses.replace(target(), **loop)  # shares the engines (and so the executables)
    model._engines, model._streams = target()._engines, target()._streams
    return jaxspec.generate(model, PROMPTS, max_new_tokens=NEW_TOKENS, speculative=speculative(method),
                            stop_token_ids=list(stop_ids), **kwargs)


@functools.cache
def reference(method, stop_ids: tuple = ()):
    return run(SYNC, method, stop_ids)


def mid_block_stop(method) -> tuple[int, ...]:
    """A stop id that first appears in the middle of request 0's synchronous output: with a drafter
    that accepts blocks it falls inside one, so the tokens after it in that block must be cut."""
    tokens = reference(method).token_ids[0]
    return (next(t for t in tokens[3:] if t not in tokens[:3]),)


@pytest.mark.parametrize("method", [None, "ngram", "draft_model", "mtp", "replay"])
def test_async_and_multi_round_dispatch_equal_the_synchronous_loop(method):
    stop = mid_block_stop(method)
    want, want_stopped = reference(method), reference(method, stop)
    assert any(r == "stop" for r in want_stopped.finish_reasons)
    if method is not None:
        assert max(n for n, c in enumerate(want.stats.emitted_histogram) if c) > 1  # blocks were accepted
    for loop in LOOPS:
        got = run(loop, method)
        assert got.token_ids == want.token_ids, loop
        assert (got.stats.accepted, got.stats.verify_steps) == (want.stats.accepted, want.stats.verify_steps), loop
        stopped = run(loop, method, stop)
        assert stopped.token_ids == want_stopped.token_ids and stopped.finish_reasons == want_stopped.finish_reasons
        assert all(len(t) <= NEW_TOKENS for t in stopped.token_ids)
    assert_idle(target())


@pytest.mark.parametrize("method", [None, "ngram"])
def test_sampling_is_identical_under_async_dispatch(method):
    settings = dict(temperature=0.8, top_k=40, top_p=0.9, seed=[1, 2, 3, 4, 5])
    want = run(SYNC, method, **settings)
    assert want.token_ids != reference(method).token_ids  # really sampled
    for loop in LOOPS:
        assert run(loop, method, **settings).token_ids == want.token_ids, loop


@pytest.mark.parametrize("method", [None, "mtp"])
def test_stream_chunks_reassemble_in_order(method):
    want = reference(method).token_ids
    got = [[] for _ in PROMPTS]
    for index, new in run(LOOPS[2], method, stream=True):
        got[index] += new
    assert got == want
    assert_idle(target())


def test_stream_closed_early_frees_its_slots_and_changes_nothing_after():
    want = reference("ngram").token_ids
    stream = run(LOOPS[1], "ngram", stream=True)
    for i, _ in enumerate(stream):
        if i == 4:  # requests are running and dispatches are in flight
            break
    stream.close()
    assert_idle(target())
    assert run(LOOPS[1], "ngram").token_ids == want


def test_inert_decode_column_changes_no_token():
    """decode_tokens=2 (a plain step with one inert column, the GPU default) decodes exactly what
    the one-token step decodes, and speculation still equals it."""
    want = reference(None).token_ids
    padded = dataclasses.replace(target(), decode_tokens=2, _engines={})
    assert padded.decode_pad == 1
    assert jaxspec.generate(padded, PROMPTS, max_new_tokens=NEW_TOKENS).token_ids == want
    spec = jaxspec.generate(padded, PROMPTS, max_new_tokens=NEW_TOKENS, speculative=speculative("ngram"))
    assert spec.token_ids == want
    assert_idle(padded)


def test_bad_loop_settings_are_refused():
    for name, value in (("rounds_per_dispatch", 0), ("dispatch_ahead", -1), ("decode_tokens", 3)):
        with pytest.raises(ValueError, match=name):
            jaxspec.load("demo:qwen3", cache_dir=None, max_model_len=32, **{name: value})
