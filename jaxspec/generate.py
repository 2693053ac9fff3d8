"""`jaxspec.generate`: validate and tokenize the prompts, run them through the generation loop
(jaxspec/loop.py: continuous batching, plain or speculative rounds, stops), return or stream the
tokens with their statistics."""

from __future__ import annotations

import contextlib
import inspect
import numbers
import time
from dataclasses import dataclass, field

import jax

from jaxspec import loop, sampling
from jaxspec.loop import Request
from jaxspec.tokenizer import is_conversation


@dataclass
class GenerateStats:
    num_prompts: int = 0
    prompt_tokens: int = 0
    tokens: int = 0  # generated tokens
    steps: int = 0  # decode / verify steps
    prefill_steps: int = 0
    preemptions: int = 0  # requests stopped to free KV pages, then re-admitted by recomputation
    seconds: float = 0.0
    # speculative counters (filled when speculative= is set)
    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0
    accepted_by_position: list[int] = field(default_factory=list)
    drafted_by_position: list[int] = field(default_factory=list)
    emitted_histogram: list[int] = field(default_factory=list)  # [k+2]: verify rows by tokens emitted (1..1+k)
    k_histogram: list[int] = field(default_factory=list)  # [k+1]: rounds by the k they ran (dynamic_k varies it)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def tau(self) -> float:
        """Mean tokens emitted per verify step, the bonus token included (1.0 without speculation)."""
        return (self.accepted + self.verify_steps) / self.verify_steps if self.verify_steps else 1.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_by_position, self.drafted_by_position, strict=False)]

    def summary(self) -> str:
        line = (f"{self.tokens} tokens in {self.seconds:.2f}s ({self.tokens_per_second:.1f} tok/s), "
                f"{self.steps} steps, {self.prefill_steps} prefill chunks")
        if self.preemptions:
            line += f", {self.preemptions} preemptions"
        if self.verify_steps:
            line += (f"; drafted {self.drafted}, accepted {self.accepted} "
                     f"({100 * self.acceptance_rate:.1f}%), tau {self.tau:.2f}")
        if sum(c > 0 for c in self.k_histogram) > 1:
            line += ", rounds by k " + " ".join(f"{k}:{c}" for k, c in enumerate(self.k_histogram) if c)
        return line


@dataclass
class GenerateResult:
    token_ids: list[list[int]]
    texts: list[str] | None
    stats: GenerateStats
    finish_reasons: list[str]


def _tokenize(model, prompts) -> list[list[int]]:
    if isinstance(prompts, str) or is_conversation(prompts):  # one prompt, or one chat
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError(f"prompts must be a str, a non-empty list of str, a list of token-id lists or chat "
                         f"messages; got {prompts!r}")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str) or is_conversation(p):
            if model.tokenizer is None:
                raise ValueError("this model has no tokenizer; pass prompts as lists of token ids")
            # a chat is rendered with the model's chat template, then tokenized like text
            ids = model.tokenizer.encode(p if isinstance(p, str) else model.tokenizer.apply_chat_template(p))
        elif isinstance(p, (list, tuple)) and all(isinstance(t, int) for t in p):
            ids = list(p)
        else:
            raise ValueError(f"prompts[{i}]={p!r} must be a str or a list of int token ids (or chat messages)")
        if not ids:
            raise ValueError(f"prompts[{i}] is empty; every prompt needs at least one token")
        bad = [t for t in ids if not 0 <= t < model.config.vocab_size]
        if bad:
            raise ValueError(f"prompts[{i}] has token id {bad[0]} outside [0, {model.config.vocab_size})")
        out.append(ids)
    return out


def _requests(model, prompts, max_new_tokens, temperature, top_k, top_p, seed, stop_token_ids) -> list[Request]:
    limits = list(max_new_tokens) if isinstance(max_new_tokens, (list, tuple)) else [max_new_tokens]
    for n in limits:
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"max_new_tokens={n!r} must be an integer >= 1 (or a list of them, one per prompt)")
    sampling.validate_sampling(temperature, top_k, top_p)
    ids = _tokenize(model, prompts)
    if len(limits) == 1:
        limits = limits * len(ids)
    if len(limits) != len(ids):
        raise ValueError(f"max_new_tokens has {len(limits)} entries for {len(ids)} prompts")
    stop = frozenset(model.eos_token_ids) | _stop_ids(stop_token_ids)
    for i, (p, n) in enumerate(zip(ids, limits, strict=True)):
        if len(p) + n > model.max_model_len:
            raise ValueError(f"prompts[{i}] has {len(p)} tokens; with max_new_tokens={n} that exceeds "
                             f"max_model_len={model.max_model_len}; shorten the prompt, lower "
                             f"max_new_tokens or load with a larger max_model_len")
    seeds = seed if isinstance(seed, (list, tuple)) else [seed] * len(ids)
    if len(seeds) != len(ids):
        raise ValueError(f"seed has {len(seeds)} entries for {len(ids)} prompts")
    for s in seeds:  # checked here, not at the first step, so a stream refuses at call time too
        if not isinstance(s, numbers.Integral) or not 0 <= s < 2**32:
            raise ValueError(f"seed={s!r} must be an integer in [0, 2**32)")
    return [Request(i, p, n, stop, float(temperature), int(top_k), float(top_p), int(s))
            for i, (p, n, s) in enumerate(zip(ids, limits, seeds, strict=True))]


def _stop_ids(stop_token_ids) -> frozenset[int]:
    """None, one id or an iterable of ids -> frozenset of ints."""
    ids = [stop_token_ids] if isinstance(stop_token_ids, numbers.Integral) else list(stop_token_ids or ())
    bad = [t for t in ids if not isinstance(t, numbers.Integral)]
    if bad:
        raise ValueError(f"stop_token_ids contains {bad[0]!r}; each entry must be an int token id")
    return frozenset(int(t) for t in ids)


def _events(model, requests, speculative, stats):
    return loop.run(model, requests, speculative, stats)


def _step_events(model, requests, speculative, stats, eager: bool):
    events = _events(model, requests, speculative, stats)
    return _op_by_op(events) if eager else events


def _op_by_op(events):
    """Run every step of `events` without jit (jax.disable_jit), the analogue of "CUDA graphs off":
    the same prefill / decode / speculative round, op by op, for A/B correctness checks."""
    try:
        while True:
            with jax.disable_jit():
                event = next(events, None)
            if event is None:
                return
            yield event
    finally:
        events.close()


def generate(model, prompts, *, max_new_tokens: int | list[int] = 128, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, seed: int | list[int] = 0, stop_token_ids=None, speculative=None,
             stream: bool = False, eager: bool = False):
    """Generate continuations for one prompt or many.

    prompts: a str, a list of str, a list of token-id lists, or chat messages: one conversation
    ([{"role": "user", "content": "..."}]) or a list of conversations, rendered with the model's chat
    template (with the generation prompt) and then tokenized. Returns a GenerateResult with
    .token_ids (generated ids per prompt), .texts (when the model has a tokenizer) and .stats; with
    stream=True returns an iterator of (request index, new token ids) in production order, with
    .stats and .close(); a stream left half-read is ended (its slots freed) by the model's next
    generate or score call.
    max_new_tokens: one limit for every prompt, or a list with one per prompt.
    eager=True runs every step op by op instead of through the compiled executables (slow; for A/B).
    Requests beyond max_num_seqs wait for a free slot. Random numbers are keyed by (seed, request
    index, position), so a prompt's sample does not depend on what else is in the batch.
    """
    requests = _requests(model, prompts, max_new_tokens, temperature, top_k, top_p, seed, stop_token_ids)
    if speculative is not None:
        from jaxspec.speculative.config import check_speculative

        check_speculative(speculative, model, len(requests))
    end_open_streams(model)
    stats = GenerateStats(num_prompts=len(requests), prompt_tokens=sum(len(r.prompt) for r in requests))
    if stream:
        events = GenerateStream(_timed(_step_events(model, requests, speculative, stats, eager), stats), stats)
        model._streams.add(events)
        return events
    for _ in _timed(_step_events(model, requests, speculative, stats, eager), stats):
        pass
    texts = None
    if model.tokenizer is not None:
        texts = [model.tokenizer.decode(r.generated) for r in requests]
    return GenerateResult([r.generated for r in requests], texts, stats, [r.finish_reason for r in requests])


class GenerateStream:
    """Iterator of (request index, new token ids); `.stats` fills in as it runs. Closing it (or
    dropping it) ends generation early and frees the engine's slots. A later generate / score call
    on the same model ends a stream left half-read, so an abandoned stream never blocks the engine."""

    def __init__(self, events, stats: GenerateStats):
        self._events, self.stats, self._ended_by_later_call = events, stats, False

    def __iter__(self):
        return self

    def __next__(self) -> tuple[int, list[int]]:
        if self._ended_by_later_call:
            raise RuntimeError("this stream was ended (and its slots freed) by a later generate or score call "
                               "on the same model; finish or close a stream before starting another call")
        return next(self._events)

    def close(self) -> None:
        self._events.close()

    def end_if_started(self) -> None:
        """Close a stream that holds slots (started, not finished); an unstarted one holds none."""
        if inspect.getgeneratorstate(self._events) == inspect.GEN_SUSPENDED:
            self._ended_by_later_call = True
            self.close()


def end_open_streams(model) -> None:
    """End the model's half-read streams, freeing their slots for the call about to start."""
    for stream in list(model._streams):
        stream.end_if_started()


def _timed(events, stats: GenerateStats):
    start = time.perf_counter()
    with contextlib.closing(events):  # closing this stream closes the request loop (frees slots)
        for index, new in events:
            stats.tokens += len(new)
            stats.seconds = time.perf_counter() - start
            if new:
                yield index, new
    stats.seconds = time.perf_counter() - start


def score(model, token_ids: list[int], *, incremental: bool = False):
    """Float32 logits [len(token_ids), V] for a token-id sequence (position i predicts token i+1).
    incremental=True runs the decode path token by token instead of chunked prefill."""
    ids = _tokenize(model, [list(token_ids)])[0]
    if len(ids) > model.max_model_len:
        raise ValueError(f"{len(ids)} tokens exceed max_model_len={model.max_model_len}")
    end_open_streams(model)
    return model.engine(model.decode_pad).score(ids, incremental=incremental)
