"""The engine owns the caches, the device-resident loop state, the request slots and the KV page
allocator of one (model, EngineConfig), and the prefill and scoring executables. It knows nothing
about prompts or stopping: jaxspec/loop.py drives it (docs/architecture.md, "Life of a request").

Sizes that define an executable (request bucket R, tokens per row T, mode) are static; everything
per request or per step is an array argument, so the same executable serves every step of its shape.
Everything a round needs per slot (last token, position, emitted count, block table, sampling
settings) lives on the device in `LoopState`, so a round's inputs are produced on the device by the
round before it and the host sends only what changed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import cache, ops, sampling, sharding
from jaxspec.config import EngineConfig, ModelConfig, prefill_row_buckets
from jaxspec.models.model import StepBatch, forward


@jax.tree_util.register_dataclass
@dataclass
class LoopState:
    """Per-slot loop state on the device; index = engine slot, 0 = the null slot of padding rows.

    A round reads its rows' entries and writes them back, so round N + 1 is built on the device from
    round N's outputs. The host writes a slot only when a request is admitted (set_slot) and the
    block tables when pages were reserved (Engine.sync_tables)."""

    last_token: jax.Array  # [S+1] int32, the committed token not yet in the cache (x0 of the next round)
    position: jax.Array  # [S+1] int32, tokens in the cache (x0's position)
    num_emitted: jax.Array  # [S+1] int32, tokens the last round emitted (1..1+k; 1 after prefill)
    block_tables: jax.Array  # [S+1, P] int32, KV page ids (0 = null page)
    sampling: sampling.SamplingParams  # [S+1] fields: temperature, top_k, top_p, seed, request_id


def init_loop_state(ecfg: EngineConfig, mesh=None) -> LoopState:
    """Zeros for every slot (host arrays + one transfer, replicated over the mesh; no device compile)."""
    n = ecfg.max_num_seqs + 1
    zeros = lambda dtype: np.zeros((n,), dtype)  # noqa: E731
    host = LoopState(last_token=zeros(np.int32), position=zeros(np.int32), num_emitted=np.ones((n,), np.int32),
                     block_tables=np.zeros((n, ecfg.pages_per_seq), np.int32),
                     sampling=sampling.SamplingParams(temperature=zeros(np.float32), top_k=zeros(np.int32),
                                                      top_p=np.ones((n,), np.float32), seed=zeros(np.uint32),
                                                      request_id=zeros(np.int32)))
    return sharding.put(host, mesh)


@functools.partial(jax.jit, donate_argnums=(0,))
def set_slot(state: LoopState, slot, settings: dict) -> LoopState:
    """Write one admitted request's sampling settings into its slot (slot [1]; settings: scalars)."""
    sp = state.sampling
    new = sampling.SamplingParams(**{name: getattr(sp, name).at[slot].set(settings[name])
                                     for name in ("temperature", "top_k", "top_p", "seed", "request_id")})
    return LoopState(state.last_token, state.position, state.num_emitted, state.block_tables, new)


def state_indices(seq_slot, num_emitted, slots_per_seq: int, conv_per_state_slot: bool) -> dict:
    """GDN state and conv-line indices of each row, computed on device (docs/architecture.md,
    "GDN rollback").

    seq_slot [R] (0 = padding row), num_emitted [R] (1..1+k, from the previous round). The request in
    slot s owns state slots base .. base+k with base = 1 + (s-1)*slots_per_seq; the start state is read
    from base + num_emitted - 1 and the state after token t written to base + t. The conv window is
    one line per request read at offset num_emitted - 1 (or, for conv_per_state_slot engines, one
    line per state slot, indexed like the state).
    """
    live = seq_slot > 0
    base = jnp.where(live, 1 + (seq_slot - 1) * slots_per_seq, 0)
    read = jnp.where(live, base + num_emitted - 1, 0)
    if conv_per_state_slot:
        conv = dict(conv_read=read, conv_offset=jnp.zeros_like(read), conv_write=base)
    else:
        conv = dict(conv_read=seq_slot, conv_offset=jnp.where(live, num_emitted - 1, 0), conv_write=seq_slot)
    return dict(state_read=read, state_write=base, **conv)


def make_batch(tokens, start_pos, num_valid, block_tables, seq_slot, num_emitted, ecfg: EngineConfig) -> StepBatch:
    """StepBatch of rows in slots seq_slot [R] with num_emitted [S+1] the device-resident counts."""
    slots = state_indices(seq_slot, num_emitted[seq_slot], ecfg.state_slots_per_seq, ecfg.conv_per_state_slot)
    return StepBatch(tokens=tokens, start_pos=start_pos, num_valid=num_valid, block_tables=block_tables, **slots)


def prefill_chunk(params, caches, state: LoopState, tokens, start_pos, num_valid, slot, *, cfg: ModelConfig,
                  ecfg: EngineConfig, kernels: str, with_hidden: bool, taps: tuple[int, ...] = ()):
    """One prompt chunk of one request: tokens [1, C] at positions start_pos [1] .., num_valid [1]
    real. Samples the token after the chunk's last valid position and records it in the loop state
    as the slot's next round input (last_token, position, num_emitted = 1); the final chunk's
    values are the ones that stay. Returns (token [1] int32, caches, state[, hidden [1, C, H]]);
    with taps (static layer ids), hidden is the taps [1, C, len(taps) * H] (model.forward)."""
    batch = make_batch(tokens, start_pos, num_valid, state.block_tables[slot], slot, state.num_emitted, ecfg)
    logits, hidden, caches = forward(params, cfg, caches, batch, mode="prefill", kernels=kernels, last_only=True,
                                     taps=taps)
    sp = jax.tree_util.tree_map(lambda x: x[slot], state.sampling)
    end = start_pos + num_valid  # [1], the position of the sampled token
    token = sampling.sample(logits, sp, end[:, None])[:, 0]  # [1]
    state = LoopState(last_token=state.last_token.at[slot].set(token), position=state.position.at[slot].set(end),
                      num_emitted=state.num_emitted.at[slot].set(1), block_tables=state.block_tables,
                      sampling=state.sampling)
    return (token, caches, state, hidden) if with_hidden else (token, caches, state)


def logits_chunk(params, caches, state: LoopState, tokens, start_pos, num_valid, slot, *, cfg: ModelConfig,
                 ecfg: EngineConfig, mode: str, kernels: str):
    """Float32 logits [1, T, V] of every position of one chunk (for scoring); num_emitted[slot] <- 1."""
    batch = make_batch(tokens, start_pos, num_valid, state.block_tables[slot], slot, state.num_emitted, ecfg)
    logits, _, caches = forward(params, cfg, caches, batch, mode=mode, kernels=kernels, last_only=False)
    return logits, caches, LoopState(state.last_token, state.position, state.num_emitted.at[slot].set(1),
                                     state.block_tables, state.sampling)


def memory_plan(model, ecfg: EngineConfig) -> dict[str, int]:
    """Bytes of the weights and of each cache component for this engine configuration."""
    return {"weights": cache.params_bytes(model.params), **cache.cache_bytes(model.config, ecfg, model.dtype)}


def prefill_executable(cfg: ModelConfig, ecfg: EngineConfig, kernels: str, with_hidden: bool = False,
                       taps: tuple[int, ...] = ()):
    """The jitted prefill chunk; shared by every Engine (and precompile) with these settings so
    re-creating an engine never retraces. Caches and loop state are donated. The settings are
    normalised before the cache lookup: functools.cache keys on the arguments as passed, and a
    call that left the defaults out got another jit object, which retraced what precompile had
    already compiled."""
    return _prefill_executable(cfg, ecfg, kernels, bool(with_hidden), tuple(taps))


@functools.cache
def _prefill_executable(cfg: ModelConfig, ecfg: EngineConfig, kernels: str, with_hidden: bool,
                        taps: tuple[int, ...]):
    return jax.jit(functools.partial(prefill_chunk, cfg=cfg, ecfg=ecfg, kernels=kernels, with_hidden=with_hidden,
                                     taps=taps), donate_argnums=(1, 2))


@functools.cache
def logits_executable(cfg: ModelConfig, ecfg: EngineConfig, kernels: str):
    return jax.jit(functools.partial(logits_chunk, cfg=cfg, ecfg=ecfg, kernels=kernels),
                   static_argnames=("mode",), donate_argnums=(1, 2))


@functools.lru_cache(maxsize=1024)
def _device_int32(values: tuple, mesh=None) -> jax.Array:
    """A cached device copy (replicated over the mesh) of a small int32 vector (row slots, chunk
    metadata): the same rows step after step cost no host-to-device transfer."""
    return sharding.put(np.asarray(values, np.int32), mesh)


def _chunk_meta(start: int, num_valid: int, slot: int, mesh) -> tuple:
    """(start_pos [1], num_valid [1], slot [1]) device arrays of one chunk."""
    return _device_int32((start,), mesh), _device_int32((num_valid,), mesh), _device_int32((slot,), mesh)


class Engine:
    """Caches + loop state + slots + pages + prefill / scoring executables for one model and one
    EngineConfig. The one owner of KV page reservation: every caller goes through `reserve`."""

    def __init__(self, model, ecfg: EngineConfig, *, memory_budget: int | None = None):
        self.model, self.cfg, self.ecfg = model, model.config, ecfg
        self.mesh = model.config.mesh
        self.kernels = ops.resolve_kernels(model.kernels)
        self.memory_plan = memory_plan(model, ecfg)
        budget = memory_budget if memory_budget is not None else cache.budget_of(model)
        cache.check_budget(self.memory_plan, budget)  # refuse before allocating anything
        self.caches = cache.allocate(self.cfg, ecfg, model.dtype)
        self.state = init_loop_state(ecfg, self.mesh)
        self.pages = cache.PageAllocator(ecfg.total_pages)
        self.block_tables = np.zeros((ecfg.max_num_seqs + 1, ecfg.pages_per_seq), np.int32)  # host mirror
        self._tables_dirty = False
        self.slot_pages: dict[int, list[int]] = {}
        self.free_slots = list(range(ecfg.max_num_seqs, 0, -1))

    # ---- slots and pages -----------------------------------------------------------------------
    def acquire_slot(self, slot: int | None = None) -> int:
        """Take a free slot (a specific one when a draft engine mirrors its target's slot)."""
        if not self.free_slots or (slot is not None and slot not in self.free_slots):
            which = "no request slot is free" if slot is None else f"request slot {slot} is not free"
            raise RuntimeError(f"{which}; free slots: {sorted(self.free_slots)} of 1..{self.ecfg.max_num_seqs}")
        slot = self.free_slots.pop() if slot is None else slot
        if slot in self.free_slots:
            self.free_slots.remove(slot)
        self.slot_pages[slot] = []
        return slot

    def release_slot(self, slot: int) -> None:
        """Free the slot and its pages. A round already enqueued may still write them: the device
        runs it before anything enqueued later, so the next owner's writes come after."""
        self.pages.free(self.slot_pages.pop(slot))
        self.block_tables[slot] = 0
        self._tables_dirty = True
        self.free_slots.append(slot)

    def reserve(self, slot: int, num_tokens: int) -> None:
        """Make sure positions [0, min(num_tokens, the block table)) of the slot have KV pages.
        Positions past max_model_len are never written (rounds mask them), so they need none."""
        have = self.slot_pages[slot]
        need = min(-(-num_tokens // self.ecfg.page_size), self.ecfg.pages_per_seq)
        if need > len(have):
            new = self.pages.allocate(need - len(have))
            self.block_tables[slot, len(have):need] = new
            have.extend(new)
            self._tables_dirty = True

    def sync_tables(self) -> None:
        """Send the block tables to the loop state if pages changed since the last call (one
        [S+1, P] int32 transfer; most rounds send nothing because pages are reserved ahead)."""
        if self._tables_dirty:
            tables = sharding.put(self.block_tables, self.mesh)
            s = self.state
            self.state = LoopState(s.last_token, s.position, s.num_emitted, tables, s.sampling)
            self._tables_dirty = False

    # ---- requests ------------------------------------------------------------------------------
    def set_sampling(self, slot: int, *, temperature=0.0, top_k=0, top_p=1.0, seed=0, request_id=0) -> None:
        """Record an admitted request's sampling settings in its slot (a transfer of 5 scalars)."""
        host = dict(temperature=np.float32(temperature), top_k=np.int32(top_k), top_p=np.float32(top_p),
                    seed=np.uint32(seed), request_id=np.int32(request_id))
        self.state = set_slot(self.state, _device_int32((slot,), self.mesh), sharding.put(host, self.mesh))

    def prefill(self, slot: int, prompt: list[int], on_hidden=None, taps: tuple[int, ...] = ()) -> jax.Array:
        """Prefill a prompt into the slot in fixed chunks (the slot's sampling settings set first).
        Returns the first sampled token as a device array [1]; the loop state holds it as the
        slot's next input, so the first round can be enqueued without reading it.

        on_hidden(start, hidden [1, C, H], next_tokens): called after each chunk with the chunk's
        final hidden states (on device) and the token after each of its positions (the prompt's
        next token; the first sampled token after the last one), as the MTP drafter consumes them;
        with taps, the hidden states are the taps of those layers (EAGLE-3, DFlash)."""
        C = self.ecfg.prefill_chunk
        self.reserve(slot, len(prompt))
        self.sync_tables()
        run = prefill_executable(self.cfg, self.ecfg, self.kernels, on_hidden is not None, tuple(taps))
        pos, token = 0, None
        while pos < len(prompt):
            chunk = prompt[pos:pos + C]
            tokens = np.zeros((1, C), np.int32)
            tokens[0, :len(chunk)] = chunk
            token, self.caches, self.state, *hidden = run(self.model.params, self.caches, self.state,
                                                          sharding.put(tokens, self.mesh),
                                                          *_chunk_meta(pos, len(chunk), slot, self.mesh))
            if on_hidden is not None:
                nxt = list(prompt[pos + 1:pos + 1 + len(chunk)])
                if len(nxt) < len(chunk):  # the last position's next token is the sampled one
                    nxt.append(int(np.asarray(token)[0]))  # a host read, not a device op
                on_hidden(pos, hidden[0], nxt)
            pos += len(chunk)
        return token

    def prefill_many(self, jobs: list[tuple[int, list[int], object]], rows: int,
                     taps: tuple[int, ...] = ()) -> tuple[list[tuple[jax.Array, int]], int]:
        """Prefill several requests' prompts [(slot, prompt, on_hidden or None), ...] (sampling
        settings set first), `rows` chunks per call: each call takes the next chunk of up to `rows`
        requests that still have one, padded with rows of the null slot 0 that write nothing the
        slots read. A row's computation is its own, so every request gets the tokens its one-request
        prefill gives (up to float rounding of the larger matmuls). Requests whose prompt hidden
        states are consumed (on_hidden, taps: see prefill) go one per call. Returns where each job's
        first sampled token is, (device array, row: no slicing on device, which would compile), and
        the number of executable calls."""
        C = self.ecfg.prefill_chunk
        if rows == 1 or len(jobs) == 1 or taps or any(hook is not None for _, _, hook in jobs):
            return [(self.prefill(slot, prompt, hook, taps=taps), 0) for slot, prompt, hook in jobs], \
                sum(-(-len(prompt) // C) for _, prompt, _ in jobs)
        for slot, prompt, _ in jobs:
            self.reserve(slot, len(prompt))
        self.sync_tables()
        run = prefill_executable(self.cfg, self.ecfg, self.kernels)
        done = [0] * len(jobs)
        first: list[tuple[jax.Array, int] | None] = [None] * len(jobs)
        calls = 0
        while True:
            todo = [i for i, (_, prompt, _) in enumerate(jobs) if done[i] < len(prompt)][:rows]
            if not todo:
                return first, calls
            width = next(b for b in prefill_row_buckets(rows) if b >= len(todo))  # the smallest row bucket
            tokens, meta = np.zeros((width, C), np.int32), np.zeros((3, width), np.int32)  # start, num_valid, slot
            for r, i in enumerate(todo):
                slot, prompt, _ = jobs[i]
                chunk = prompt[done[i]:done[i] + C]
                tokens[r, :len(chunk)] = chunk
                meta[:, r] = done[i], len(chunk), slot
            token, self.caches, self.state = run(self.model.params, self.caches, self.state,
                                                 sharding.put(tokens, self.mesh),
                                                 *(_device_int32(tuple(int(x) for x in m), self.mesh) for m in meta))
            calls += 1
            for r, i in enumerate(todo):
                done[i] += int(meta[1, r])
                if done[i] >= len(jobs[i][1]):
                    first[i] = token, r

    def logits(self, slot: int, tokens: list[int], start_pos: int, *, chunk: int | None = None) -> np.ndarray:
        """Float32 logits [len(tokens), V] of tokens fed to the slot from start_pos, in chunks of
        `chunk` (default the prefill chunk; 1 = the one-token verify path)."""
        C = chunk or self.ecfg.prefill_chunk
        mode = "verify" if C == 1 else "prefill"
        run = logits_executable(self.cfg, self.ecfg, self.kernels)
        self.reserve(slot, start_pos + len(tokens))
        self.sync_tables()
        out, pos = [], 0
        while pos < len(tokens):
            part = tokens[pos:pos + C]
            ids = np.zeros((1, C), np.int32)
            ids[0, :len(part)] = part
            logits, self.caches, self.state = run(self.model.params, self.caches, self.state,
                                                  sharding.put(ids, self.mesh),
                                                  *_chunk_meta(start_pos + pos, len(part), slot, self.mesh), mode=mode)
            out.append(np.asarray(logits)[0, :len(part)])
            pos += len(part)
        return np.concatenate(out, axis=0)

    def score(self, tokens: list[int], *, incremental: bool = False) -> np.ndarray:
        """Float32 logits [len(tokens), V] of a token sequence: by chunked prefill, or (incremental)
        by prefilling the first token and decoding the rest one at a time."""
        slot = self.acquire_slot()
        try:
            if not incremental:
                return self.logits(slot, tokens, 0)
            return np.concatenate([self.logits(slot, tokens[:1], 0), self.logits(slot, tokens[1:], 1, chunk=1)]) \
                if len(tokens) > 1 else self.logits(slot, tokens, 0)
        finally:
            self.release_slot(slot)
