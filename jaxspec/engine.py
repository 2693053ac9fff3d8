"""The engine owns the caches, the request slots, the KV page allocator and the jitted step functions
of one (model, EngineConfig). It knows nothing about prompts or stopping; generate.py drives it.

Sizes that define an executable (request bucket R, tokens per row T, mode) are static; everything
per request or per step is an array argument, so the same executable serves every step of its shape.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import cache, ops, sampling
from jaxspec.config import EngineConfig, ModelConfig
from jaxspec.models.model import StepBatch, forward


@dataclass
class Row:
    """Host view of one request's row in a step."""

    slot: int  # engine slot 1..max_num_seqs
    tokens: list[int]  # the row's input tokens (<= T)
    start_pos: int  # tokens already cached
    request_id: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0


def row_sampling(rows: list[Row], R: int) -> sampling.SamplingParams:
    """Per-row sampling settings padded to R rows (padding rows: greedy, request 0). The same rows
    step after step reuse one set of device arrays (no host-to-device copies per step)."""
    settings = tuple((r.temperature, r.top_k, r.top_p, r.seed, r.request_id) for r in rows)
    return _sampling_arrays(settings + ((0.0, 0, 1.0, 0, 0),) * (R - len(rows)))


@functools.lru_cache(maxsize=256)
def _sampling_arrays(settings: tuple) -> sampling.SamplingParams:
    """Device SamplingParams of per-row (temperature, top_k, top_p, seed, request_id); never donated."""
    temperature, top_k, top_p, seed, request_id = (list(column) for column in zip(*settings, strict=True))
    return sampling.make_sampling_params(len(settings), temperature=temperature, top_k=top_k, top_p=top_p,
                                         seed=seed, request_id=request_id)


@dataclass
class StepInputs:
    """Device arrays for one step, padded to the bucket (R, T)."""

    batch: dict = field(default_factory=dict)  # tokens, start_pos, num_valid, block_tables, seq_slot
    sampling: sampling.SamplingParams | None = None


def state_indices(seq_slot, num_accepted, slots_per_seq: int, conv_per_state_slot: bool) -> dict:
    """GDN state and conv-line indices of each row (DESIGN.md §5), computed on device.

    seq_slot [R] (0 = padding row), num_accepted [R] (1..1+k, from the previous round). The request in
    slot s owns state slots base .. base+k with base = 1 + (s-1)*slots_per_seq; the start state is read
    from base + num_accepted - 1 and the state after token t written to base + t. The conv window is
    one line per request read at offset num_accepted - 1 (or, for conv_per_state_slot engines, one
    line per state slot, indexed like the state).
    """
    live = seq_slot > 0
    base = jnp.where(live, 1 + (seq_slot - 1) * slots_per_seq, 0)
    read = jnp.where(live, base + num_accepted - 1, 0)
    if conv_per_state_slot:
        conv = dict(conv_read=read, conv_offset=jnp.zeros_like(read), conv_write=base)
    else:
        conv = dict(conv_read=seq_slot, conv_offset=jnp.where(live, num_accepted - 1, 0), conv_write=seq_slot)
    return dict(state_read=read, state_write=base, **conv)


def make_batch(inputs: dict, num_accepted, ecfg: EngineConfig) -> StepBatch:
    """StepBatch from host inputs (tokens, start_pos, num_valid, block_tables, seq_slot) and the
    device-resident num_accepted [S+1]."""
    fields = {k: v for k, v in inputs.items() if k != "seq_slot"}
    slots = state_indices(inputs["seq_slot"], num_accepted[inputs["seq_slot"]], ecfg.state_slots_per_seq,
                          ecfg.conv_per_state_slot)
    return StepBatch(**fields, **slots)


def step(params, caches, num_accepted, inputs: dict, sp: sampling.SamplingParams, *, cfg: ModelConfig,
         ecfg: EngineConfig, mode: str, kernels: str, last_only: bool, with_hidden: bool = False):
    """One forward + on-device sampling. num_accepted [S+1] int32 lives on device (index = slot).

    Returns (tokens [R, T'] int32, caches, num_accepted) with T' = 1 when last_only, and the final
    hidden states [R, T, H] last when with_hidden (the MTP drafter's prompt input). The token sampled
    from input position p has absolute position p + 1, which keys its random numbers.
    """
    batch = make_batch(inputs, num_accepted, ecfg)
    logits, hidden, caches = forward(params, cfg, caches, batch, mode=mode, kernels=kernels, last_only=last_only)
    if last_only:
        positions = (batch.start_pos + batch.num_valid)[:, None]  # [R, 1]
    else:
        positions = batch.start_pos[:, None] + 1 + jnp.arange(logits.shape[1], dtype=jnp.int32)[None, :]
    tokens = sampling.sample(logits, sp, positions)
    num_accepted = num_accepted.at[inputs["seq_slot"]].set(1)  # padding rows write the unused index 0
    return (tokens, caches, num_accepted, hidden) if with_hidden else (tokens, caches, num_accepted)


def logits_step(params, caches, num_accepted, inputs: dict, *, cfg: ModelConfig, ecfg: EngineConfig, mode: str,
                kernels: str):
    """Like `step` but returns the float32 logits [R, T, V] of every position (for scoring)."""
    batch = make_batch(inputs, num_accepted, ecfg)
    logits, _, caches = forward(params, cfg, caches, batch, mode=mode, kernels=kernels, last_only=False)
    return logits, caches, num_accepted.at[inputs["seq_slot"]].set(1)


def memory_plan(model, ecfg: EngineConfig) -> dict[str, int]:
    """Bytes of the weights and of each cache component for this engine configuration."""
    return {"weights": cache.params_bytes(model.params), **cache.cache_bytes(model.config, ecfg, model.dtype)}


@functools.cache
def step_executable(cfg: ModelConfig, ecfg: EngineConfig, kernels: str):
    """The jitted step for one (model config, engine config, kernels); shared by every Engine with
    these settings so re-creating an engine never retraces. Caches and num_accepted are donated."""
    return jax.jit(functools.partial(step, cfg=cfg, ecfg=ecfg, kernels=kernels),
                   static_argnames=("mode", "last_only", "with_hidden"), donate_argnums=(1, 2))


@functools.cache
def logits_executable(cfg: ModelConfig, ecfg: EngineConfig, kernels: str):
    return jax.jit(functools.partial(logits_step, cfg=cfg, ecfg=ecfg, kernels=kernels),
                   static_argnames=("mode",), donate_argnums=(1, 2))


class Engine:
    """Caches + slots + compiled steps for one model and one EngineConfig."""

    def __init__(self, model, ecfg: EngineConfig, *, memory_budget: int | None = None):
        self.model, self.cfg, self.ecfg = model, model.config, ecfg
        self.kernels = ops.resolve_kernels(model.kernels)
        self.memory_plan = memory_plan(model, ecfg)
        if memory_budget is None:
            memory_budget = getattr(model, "memory_budget", None)
        budget = memory_budget if memory_budget is not None else cache.device_memory_bytes()
        cache.check_budget(self.memory_plan, budget)  # refuse before allocating anything
        self.caches = cache.allocate(self.cfg, ecfg, model.dtype)
        self.num_accepted = jax.device_put(np.ones((ecfg.max_num_seqs + 1,), np.int32))
        self.pages = cache.PageAllocator(ecfg.total_pages)
        self.block_tables = np.zeros((ecfg.max_num_seqs + 1, ecfg.pages_per_seq), np.int32)
        self.slot_pages: dict[int, list[int]] = {}
        self.free_slots = list(range(ecfg.max_num_seqs, 0, -1))
        self._step = step_executable(self.cfg, ecfg, self.kernels)
        self._logits_step = logits_executable(self.cfg, ecfg, self.kernels)

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
        self.pages.free(self.slot_pages.pop(slot))
        self.block_tables[slot] = 0
        self.free_slots.append(slot)

    def ensure_pages(self, slot: int, num_tokens: int) -> None:
        """Make sure positions [0, num_tokens) of the slot have KV pages."""
        have = self.slot_pages[slot]
        need = -(-num_tokens // self.ecfg.page_size)
        if need > self.ecfg.pages_per_seq:
            raise ValueError(f"{num_tokens=} exceeds the block table ({self.ecfg.pages_per_seq} pages)")
        if need > len(have):
            new = self.pages.allocate(need - len(have))
            self.block_tables[slot, len(have):need] = new
            have.extend(new)

    # ---- steps ---------------------------------------------------------------------------------
    def build_inputs(self, rows: list[Row], R: int, T: int) -> StepInputs:
        """Pad rows to the (R, T) bucket; padding rows are inert (slot 0, no valid tokens)."""
        tokens = np.zeros((R, T), np.int32)
        start = np.zeros((R,), np.int32)
        valid = np.zeros((R,), np.int32)
        slots = np.zeros((R,), np.int32)
        tables = np.zeros((R, self.ecfg.pages_per_seq), np.int32)
        for i, row in enumerate(rows):
            tokens[i, :len(row.tokens)] = row.tokens
            start[i], valid[i], slots[i] = row.start_pos, len(row.tokens), row.slot
            tables[i] = self.block_tables[row.slot]
        batch = dict(tokens=tokens, start_pos=start, num_valid=valid, block_tables=tables, seq_slot=slots)
        return StepInputs(batch=jax.device_put(batch), sampling=row_sampling(rows, R))  # transfers only

    def run(self, rows: list[Row], *, T: int, mode: str, last_only: bool, with_hidden: bool = False):
        """Run one step over rows (each with <= T tokens) and return sampled tokens on the host
        (and, with_hidden, the final hidden states [R, T, H], left on device)."""
        for row in rows:
            self.ensure_pages(row.slot, row.start_pos + len(row.tokens))
        R = self.ecfg.request_bucket(len(rows))
        inputs = self.build_inputs(rows, R, T)
        tokens, self.caches, self.num_accepted, *hidden = self._step(
            self.model.params, self.caches, self.num_accepted, inputs.batch, inputs.sampling,
            mode=mode, last_only=last_only, with_hidden=with_hidden)
        tokens = np.asarray(tokens)[:len(rows)]
        return (tokens, hidden[0]) if with_hidden else tokens

    def prefill(self, row: Row, on_hidden=None) -> int:
        """Prefill one request's prompt in fixed chunks; returns the first sampled token.

        on_hidden(start, hidden [1, C, H], next_tokens): called after each chunk with the chunk's
        final hidden states (on device) and the token after each of its positions (the prompt's
        next token; the first sampled token after the last one), as the MTP drafter consumes them."""
        C = self.ecfg.prefill_chunk
        prompt, pos, token = row.tokens, row.start_pos, None
        while pos < len(prompt):
            chunk = Row(**{**row.__dict__, "tokens": prompt[pos:pos + C], "start_pos": pos})
            if on_hidden is None:
                token = int(self.run([chunk], T=C, mode="prefill", last_only=True)[0, 0])
            else:
                tokens, hidden = self.run([chunk], T=C, mode="prefill", last_only=True, with_hidden=True)
                token = int(tokens[0, 0])
                nxt = list(prompt[pos + 1:pos + 1 + len(chunk.tokens)])
                on_hidden(pos, hidden, nxt + [token] * (len(chunk.tokens) - len(nxt)))
            pos += len(chunk.tokens)
        return token

    def decode(self, rows: list[Row]) -> np.ndarray:
        """One plain decode step (T = 1) for every row; returns tokens [len(rows)]."""
        return self.run(rows, T=1, mode="verify", last_only=False)[:, 0]

    def score(self, tokens: list[int], *, incremental: bool = False) -> np.ndarray:
        """Float32 logits [len(tokens), V] of a token sequence: by chunked prefill, or (incremental)
        by prefilling the first token and decoding the rest one at a time."""
        slot = self.acquire_slot()
        try:
            out, pos = [], 0
            while pos < len(tokens):
                T = 1 if incremental and pos > 0 else self.ecfg.prefill_chunk
                mode = "verify" if T == 1 else "prefill"
                chunk = tokens[pos:pos + T]
                self.ensure_pages(slot, pos + len(chunk))
                inputs = self.build_inputs([Row(slot=slot, tokens=chunk, start_pos=pos, request_id=0)], 1, T)
                logits, self.caches, self.num_accepted = self._logits_step(
                    self.model.params, self.caches, self.num_accepted, inputs.batch, mode=mode)
                out.append(np.asarray(logits)[0, :len(chunk)])
                pos += len(chunk)
            return np.concatenate(out, axis=0)
        finally:
            self.release_slot(slot)
