"""The one generation loop, for plain decoding and every drafter alike (docs/architecture.md, "Life
of a request"): admit -> dispatch rounds -> read results one dispatch behind -> stop -> retire.

The host stays out of the device's way. A dispatch runs `rounds_per_dispatch` rounds in one
executable whose inputs come from the device-resident loop state, so it needs nothing from the
host but the rows' slots (a cached device array). Up to `dispatch_ahead` dispatches are enqueued
before the oldest one's tokens are read (they were copied to the host asynchronously meanwhile),
so Python's bookkeeping, stop checks and streaming overlap the GPU. A request that stops inside a
dispatch keeps running in the dispatches already enqueued; what it emits past its stop is
discarded, and its pages were reserved ahead for exactly that. Admission (the prompt's prefill)
reads the first token at once: it happens once per request, not once per step.

The KV pool may hold fewer pages than every slot could use (Model.num_kv_pages). A request is
admitted only while its prompt plus the positions one dispatch can write fit in the free pages;
when a running request needs a page and none is free, the latest-admitted request is preempted:
its slot and pages are freed, the tokens it already returned are kept, and it waits at the head of
the queue to be re-admitted by prefilling its prompt plus those tokens. Randomness is keyed by
(seed, request, position), so its output is the one it would have had alone.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from dataclasses import dataclass, field

import jax
import numpy as np

from jaxspec import sharding
from jaxspec.cache import MemoryBudgetError
from jaxspec.engine import _device_int32
from jaxspec.speculative.dynamic import KChooser, fitted_costs, linear_costs
from jaxspec.speculative.round import round_executable
from jaxspec.speculative.session import SESSIONS, make_session


@dataclass
class Request:
    """The one host record of a request, from tokenization to its last token."""

    index: int  # position in the generate call; keys the request's random numbers
    prompt: list[int]
    max_new_tokens: int
    stop_ids: frozenset[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    generated: list[int] = field(default_factory=list)
    slot: int = 0
    finish_reason: str | None = None
    epoch: int = 0  # admissions so far: rows of an earlier admission still in flight are ignored
    preemptions: int = 0

    @property
    def limit(self) -> int:
        """Positions the request can ever need: KV past them is never read back."""
        return len(self.prompt) + self.max_new_tokens

    @property
    def num_cached(self) -> int:
        """Tokens whose KV / state is in the cache: the prompt plus all generated but the last."""
        return len(self.prompt) + max(len(self.generated) - 1, 0)

    def extend(self, tokens) -> list[int]:
        """Append emitted tokens up to the first stop (a stop id, or max_new_tokens reached);
        returns the ones kept. Tokens after a stop are dropped: they never reach the user."""
        kept = []
        for t in tokens:
            kept.append(int(t))
            self.generated.append(int(t))
            if int(t) in self.stop_ids:
                self.finish_reason = "stop"
            elif len(self.generated) >= self.max_new_tokens:
                self.finish_reason = "length"
            if self.finish_reason:
                break
        return kept


@dataclass
class Dispatch:
    """One enqueued executable: the requests of its rows (row order) and its device outputs."""

    requests: list[Request]
    epochs: list[int]  # each row's request epoch when dispatched
    emitted: jax.Array  # [S, R, 1+k] int32
    num_emitted: jax.Array  # [S, R] int32


def run(model, requests: list[Request], spec, stats):
    """Continuous batching over `requests`, plain (spec None) or speculative; yields (request index,
    new token ids) in the order results are known. Closing the generator frees every slot."""
    k = 0 if spec is None else spec.k
    # Plain decoding may carry inert columns (Model.decode_pad); pad_to_max runs every k with the
    # k_max executable. Both are drafts beyond num_drafts: a masked tail.
    engine = model.engine(model.decode_pad if spec is None else k)
    k_run = model.decode_pad if spec is None else engine.ecfg.max_num_speculative_tokens \
        if model.k_mode == "pad_to_max" else k
    check_pool(engine, requests)  # before anything runs: a request that can never fit is refused
    session = make_session(model, engine, spec, requests, k_run)
    loop = Loop(model, engine, session, k_run, k, stats)
    if spec is not None and spec.dynamic_k:
        loop.kchoice = KChoice(model, engine, spec, loop)
    with loop.releasing():
        yield from loop.events(requests)


def check_pool(engine, requests: list[Request]) -> None:
    """Refuse a request whose prompt plus max_new_tokens exceeds the whole KV pool."""
    ecfg = engine.ecfg
    pool = (ecfg.total_pages - 1) * ecfg.page_size  # page 0 is the null page
    for req in requests:
        if req.limit > pool:
            raise ValueError(f"prompts[{req.index}] needs {len(req.prompt)} + max_new_tokens={req.max_new_tokens} = "
                             f"{req.limit} KV positions but the whole pool holds {pool} ({ecfg.total_pages - 1} pages "
                             f"of {ecfg.page_size}); shorten it, lower max_new_tokens or load with a larger "
                             f"num_kv_pages")


class Loop:
    """State of one generate call's loop: waiting, running and in-flight work."""

    def __init__(self, model, engine, session, k_run: int, k: int, stats):
        self.model, self.engine, self.session, self.stats = model, engine, session, stats
        self.k_run, self.k = k_run, k
        self.steps = model.rounds_per_dispatch
        self.ahead = model.dispatch_ahead
        self.active: list[Request] = []  # admitted, slot held, in admission order (finished ones until retired)
        self.pending: deque[Request] = deque()
        self.inflight: deque[Dispatch] = deque()
        self._num_drafts = sharding.put(np.int32(k), model.config.mesh)
        self.kchoice: KChoice | None = None  # dynamic k: picks each dispatch's drafter

    # ---- the loop ----------------------------------------------------------------------------
    def events(self, requests: list[Request]):
        pending = self.pending
        pending.extend(requests)
        while pending or self.active or self.inflight:
            self.retire()  # first, so a slot freed by the last results is reused at once
            wave = []
            while pending and self.engine.free_slots and self.fits(pending[0]):
                wave.append(self.start(pending.popleft()))
            if wave:
                for req, kept in self.admit(wave):
                    yield req.index, kept
                self.retire()  # a request may end on its first token
            running = [r for r in self.active if not r.finish_reason]
            if running and len(self.inflight) <= self.ahead:
                self.dispatch(running)
                continue
            if self.inflight:
                yield from self.collect(self.inflight.popleft())
            elif pending and not self.engine.free_slots:
                raise RuntimeError(f"all {self.engine.ecfg.max_num_seqs} request slots are held outside this "
                                   f"generation (an unfinished stream?); close that stream or let it finish first")
            elif pending and not running:
                raise RuntimeError(f"prompts[{pending[0].index}] does not fit the {self.engine.pages.num_free} free "
                                   f"KV pages although nothing else runs")

    def horizon(self, dispatches: int) -> int:
        """Positions past a request's cache that `dispatches` dispatches may write."""
        return dispatches * self.steps * (1 + self.k_run) + self.session.lookahead

    def fits(self, req: Request) -> bool:
        """Admission by free pages: the prompt (plus what a preempted request already generated)
        and one dispatch's positions must fit in the free KV pages."""
        eng = self.engine
        need = min(len(req.prompt) + len(req.generated) + self.horizon(1), req.limit)
        return -(-need // eng.ecfg.page_size) <= eng.pages.num_free

    def start(self, req: Request) -> Request:
        """Slot, sampling settings and the pages fits() counted: the prompt's and one dispatch's
        (so the next request's fit sees them taken, and the drafter's admission, which drafts up to
        its lookahead past the prompt, finds its pages). A preempted request prefills its prompt
        plus the tokens it already returned."""
        eng = self.engine
        req.slot = eng.acquire_slot()
        req.epoch += 1
        self.active.append(req)
        eng.set_sampling(req.slot, temperature=req.temperature, top_k=req.top_k, top_p=req.top_p, seed=req.seed,
                         request_id=req.index)
        eng.reserve(req.slot, min(len(req.prompt) + len(req.generated) + self.horizon(1), req.limit))
        return req

    def admit(self, wave: list[Request]) -> list[tuple[Request, list[int]]]:
        """Prefill the started requests (Model.prefill_rows of them per call, or one at a time when
        the drafter consumes each prompt's hidden states), read their first tokens back (once per
        request), then the drafter's admission. Returns each request with its new token (or
        nothing, if it already stopped)."""
        hook = self.session.prefill_hook
        jobs = [(r.slot, r.prompt + r.generated, hook(r) if hook else None) for r in wave]
        firsts, calls = self.engine.prefill_many(jobs, self.model.prefill_rows, taps=self.session.taps)
        self.stats.prefill_steps += calls
        out = []
        for req, (first, row) in zip(wave, firsts, strict=True):
            kept = req.extend([int(np.asarray(first)[row])])
            if not req.finish_reason:
                self.session.admit(req)
            out.append((req, kept))
        return out

    def dispatch(self, running: list[Request]) -> None:
        """Enqueue `steps` rounds for the running requests without waiting for anything."""
        eng = self.engine
        running = self.reserve(running)
        if not running:
            return
        eng.sync_tables()
        R = eng.ecfg.request_bucket(len(running))
        rows = _device_int32(tuple(r.slot for r in running) + (0,) * (R - len(running)), self.engine.mesh)
        greedy = all(r.temperature <= 0 for r in running)
        drafter, num_drafts = self.session.drafter, self._num_drafts
        if self.kchoice:
            drafter, num_drafts = self.kchoice.pick(R, greedy)
        emitted, num_emitted = self.call(self.executable(drafter, greedy), rows, num_drafts)
        jax.copy_to_host_async((emitted, num_emitted))  # lands while the next dispatch runs
        self.inflight.append(Dispatch(list(running), [r.epoch for r in running], emitted, num_emitted))

    def executable(self, drafter, greedy: bool):
        eng = self.engine
        return round_executable(self.model.config, eng.ecfg, drafter, eng.kernels, greedy, self.steps)

    def call(self, run, rows, num_drafts):
        """One dispatch of `run` for rows [R]; the caches and states it donates are taken back."""
        eng, s = self.engine, self.session
        emitted, num_emitted, eng.caches, eng.state, s.dstate = run(
            self.model.params, eng.caches, eng.state, s.dparams, s.dstate, rows, num_drafts, s.aux_tables())
        s.sync()
        return emitted, num_emitted

    def reserve(self, running: list[Request]) -> list[Request]:
        """Pages for every position the dispatches in flight and this one may write (each round
        writes at most 1 + k positions past the request's host-known cache length; never past its
        limit: rows beyond it are discarded and write only the null page). When the pool runs dry,
        preempt the latest-admitted running request. Returns the requests still running."""
        horizon = self.horizon(len(self.inflight) + 1)
        for req in list(running):
            need = min(req.num_cached + horizon, req.limit)
            while req in running:
                try:
                    self.engine.reserve(req.slot, need)
                    self.session.reserve(req, need)
                    break
                except MemoryBudgetError:
                    victim = running[-1]  # running follows admission order
                    self.preempt(victim)
                    running.remove(victim)
        return running

    def preempt(self, req: Request) -> None:
        """Free req's slot and pages now; it waits at the head of the queue and is re-admitted by
        recomputing its prompt plus the tokens it already returned. Its rows in flight are ignored."""
        self.active.remove(req)
        self._release(req)
        req.epoch += 1  # its rows still in flight belong to the old admission
        req.preemptions += 1
        self.stats.preemptions += 1
        self.pending.appendleft(req)

    def collect(self, d: Dispatch):
        """Read one dispatch's results (a round behind the device) and hand out its tokens."""
        emitted, num_emitted = jax.device_get((d.emitted, d.num_emitted))  # [S, R, 1+k], [S, R]
        for s in range(emitted.shape[0]):
            live = [i for i, r in enumerate(d.requests) if not r.finish_reason and r.epoch == d.epochs[i]]
            if not live:
                break
            self.record(num_emitted[s, live], emitted.shape[2] - 1)
            for i in live:
                req = d.requests[i]
                yield req.index, req.extend(emitted[s, i, :num_emitted[s, i]].tolist())

    def record(self, num_emitted: np.ndarray, k_run: int) -> None:
        """Step and acceptance counters of one round's live rows (num_emitted [n] in 1..1+k) run
        with k_run draft columns (k verified: k_run, or the call's k under pad_to_max)."""
        st = self.stats
        st.steps += 1
        if not self.k:
            return
        k = k_run if self.kchoice else self.k
        if self.kchoice:
            self.kchoice.chooser.observe(k, num_emitted)
        st.verify_steps += len(num_emitted)
        st.drafted += k * len(num_emitted)
        st.accepted += int(np.sum(num_emitted - 1))
        if not st.drafted_by_position:
            st.drafted_by_position, st.accepted_by_position = [0] * self.k, [0] * self.k
            st.emitted_histogram = [0] * (self.k + 2)  # index = tokens emitted by a row, 1..1+k
            st.k_histogram = [0] * (self.k + 1)  # index = the round's k
        st.k_histogram[k] += 1
        for n in num_emitted:
            st.emitted_histogram[n] += 1
        for i in range(k):
            st.drafted_by_position[i] += len(num_emitted)
            st.accepted_by_position[i] += int(np.sum(num_emitted - 1 > i))

    # ---- slots -------------------------------------------------------------------------------
    def retire(self) -> None:
        """Free the slots of finished requests (dispatches in flight may still hold their rows:
        the device runs those before anything enqueued after this, and their tokens are dropped)."""
        for req in [r for r in self.active if r.finish_reason]:
            self.active.remove(req)
            self._release(req)

    def _release(self, req: Request) -> None:
        self.session.release(req)
        self.engine.release_slot(req.slot)

    @contextlib.contextmanager
    def releasing(self):
        """Free every slot still held when generation ends early (error, abandoned stream)."""
        try:
            yield
        finally:
            for req in self.active:
                self._release(req)
            self.active.clear()
            self.inflight.clear()


# ---- dynamic k ---------------------------------------------------------------------------------
_measured: dict = {}  # (round executable, R) -> seconds of one dispatch, measured once per process


class KChoice:
    """Dynamic k (speculative/dynamic.py): a drafter per k bucket, all sharing the session's state
    (sized by the engine's k_max), and the choice among them per dispatch."""

    def __init__(self, model, engine, spec, loop: Loop):
        self.loop, self.spec = loop, spec
        self.chooser = KChooser(spec.k_buckets)
        lookup = (spec.prompt_lookup_min, spec.prompt_lookup_max)
        self.drafters = {k: SESSIONS[spec.method].make_drafter(model, engine.ecfg, k, prompt_lookup=lookup,
                                                               draft_model=spec.draft_model) for k in spec.k_buckets}
        self.num_drafts = {k: sharding.put(np.int32(k), model.config.mesh) for k in spec.k_buckets}

    def pick(self, R: int, greedy: bool):
        """(drafter, num_drafts) of the bucket with the most expected tokens per unit of cost."""
        k = self.chooser.choose(self.costs(R, greedy))
        return self.drafters[k], self.num_drafts[k]

    def costs(self, R: int, greedy: bool) -> np.ndarray:
        """Each bucket's round cost: the linear model of dynamic_k_cost, or measured dispatch times."""
        ks = self.chooser.ks
        if self.spec.dynamic_k_cost is not None:
            return linear_costs(ks, self.spec.dynamic_k_cost)
        runs = [self.loop.executable(self.drafters[k], greedy) for k in ks]
        missing = [(run, k) for run, k in zip(runs, ks, strict=True) if (run, R) not in _measured]
        if missing:
            jax.block_until_ready(self.loop.engine.state)  # time the buckets alone, once per process
            rows = _device_int32((0,) * R, self.loop.engine.mesh)  # padding rows: full shapes, null slot only
            for run, k in missing:
                _measured[run, R] = self.time(run, rows, self.num_drafts[k])
        return fitted_costs(ks, [_measured[run, R] for run in runs])

    def time(self, run, rows, num_drafts, repeats: int = 3) -> float:
        """Fastest of `repeats` dispatches after a first one (which may load the executable)."""
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            jax.block_until_ready(self.loop.call(run, rows, num_drafts))
            times.append(time.perf_counter() - start)
        return min(times[1:])
