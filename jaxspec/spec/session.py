"""Host side of a drafter during one generate call: its static (jit) description, its device
parameters and state, and the admit / release hooks that keep it in step with the target's slots."""

from __future__ import annotations

from dataclasses import dataclass, field

import jax.numpy as jnp
import numpy as np

from jaxspec.config import EngineConfig
from jaxspec.spec.drafters import DraftModelDrafter, NgramDrafter, ReplayDrafter


@dataclass
class Session:
    drafter: object  # frozen dataclass: NgramDrafter | ReplayDrafter | DraftModelDrafter
    dparams: object = None
    dstate: object = None
    draft_engine: object = None
    replay: tuple = ()
    extra: dict = field(default_factory=dict)

    def admit(self, req) -> None:
        """Called after the target prefilled req (req.generated holds its first token)."""
        if isinstance(self.drafter, NgramDrafter):
            self.dstate = self.drafter.admit(self.dstate, req.slot, req.prompt + req.generated)
        elif isinstance(self.drafter, ReplayDrafter):
            self.dstate = self.drafter.admit(self.dstate, req.slot, list(self.replay[req.index]), len(req.generated))
        else:
            eng = self.draft_engine
            eng.acquire_slot(req.slot)
            eng.prefill(req.row(req.prompt, 0))
            self.dstate = {"caches": eng.caches}

    def release(self, req) -> None:
        if self.draft_engine is not None and req.slot in self.draft_engine.slot_pages:
            self.draft_engine.release_slot(req.slot)

    def aux_block_tables(self, active, R: int, k: int) -> np.ndarray:
        """The draft model's block tables for the round's rows ([R, 1] zeros for model-free drafters)."""
        if self.draft_engine is None:
            return np.zeros((R, 1), np.int32)
        eng = self.draft_engine
        tables = np.zeros((R, eng.ecfg.pages_per_seq), np.int32)
        for i, req in enumerate(active):
            eng.ensure_pages(req.slot, req.num_cached + 1 + k)
            tables[i] = eng.block_tables[req.slot]
        return tables

    def sync(self) -> None:
        """Hand the draft caches back to the draft engine after a round donated them."""
        if self.draft_engine is not None:
            self.draft_engine.caches = self.dstate["caches"]


def draft_engine_config(target_ecfg: EngineConfig, draft, k: int) -> EngineConfig:
    """The draft model's engine: the target's slots and lengths, 1+k state slots and one conv window
    per state slot (it advances one token per step)."""
    return EngineConfig(max_num_seqs=target_ecfg.max_num_seqs, max_model_len=target_ecfg.max_model_len,
                        page_size=draft.page_size, prefill_chunk=draft.prefill_chunk,
                        max_num_speculative_tokens=k, conv_per_state_slot=True,
                        request_buckets=target_ecfg.request_buckets)


def make_drafter(method: str, model, ecfg: EngineConfig, k: int, *, prompt_lookup=(1, 4), draft_model=None):
    """The static (jit-keying) drafter proposing k tokens for a target engine configured by ecfg."""
    if method == "ngram":
        return NgramDrafter(k=k, n_min=prompt_lookup[0], n_max=prompt_lookup[1],
                            history_len=ecfg.max_model_len + k + 1)
    if method == "replay":  # a fixed reference length, so references of any length share executables
        return ReplayDrafter(k=k, vocab_size=model.config.vocab_size, ref_len=ecfg.max_model_len + k + 1)
    from jaxspec import ops

    return DraftModelDrafter(k=k, cfg=draft_model.config, ecfg=draft_engine_config(ecfg, draft_model, k),
                             kernels=ops.resolve_kernels(draft_model.kernels))


def make_session(model, engine, spec, requests, k: int) -> Session:
    """The drafter session for a generate call; drafters propose k tokens (spec's k, or k_max when
    the model pads every k to its maximum)."""
    num_slots = engine.ecfg.max_num_seqs + 1
    drafter = make_drafter(spec.method, model, engine.ecfg, k, draft_model=spec.draft_model,
                           prompt_lookup=(spec.prompt_lookup_min, spec.prompt_lookup_max))
    if spec.method == "ngram":
        return Session(drafter, dstate=drafter.init_state(num_slots))
    if spec.method == "replay":
        dparams = {"alpha": jnp.float32(spec.replay_alpha), "seed": jnp.uint32(spec.replay_seed)}
        return Session(drafter, dparams=dparams, dstate=drafter.init_state(num_slots), replay=spec.replay_tokens)
    draft_engine = spec.draft_model.engine_for(drafter.ecfg)
    return Session(drafter, dparams=spec.draft_model.params, dstate={"caches": draft_engine.caches},
                   draft_engine=draft_engine)
