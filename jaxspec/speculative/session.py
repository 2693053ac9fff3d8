"""Host side of a drafter during one generate call: its static (jit) description, its device
parameters and state, and the admit / release hooks that keep it in step with the target's slots."""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import EngineConfig
from jaxspec.speculative import mtp
from jaxspec.speculative.drafters import DraftModelDrafter, NgramDrafter, NoDrafter, ReplayDrafter


@dataclass
class Session:
    """A drafter in one generate call: its static description (a jit key), device params and
    state, and the host hooks the loop calls (admit, release, reserve, aux_tables, sync)."""

    drafter: object  # frozen dataclass: NoDrafter | NgramDrafter | ReplayDrafter | DraftModelDrafter | MtpDrafter
    dparams: object = None
    dstate: object = None
    draft_engine: object = None
    replay: tuple = ()
    extra: dict = field(default_factory=dict)

    @property
    def lookahead(self) -> int:
        """Positions past a round's verify span that the drafter writes in the target's KV pages
        (the MTP head's recursive rows reach k - 1 past them)."""
        return self.drafter.k if isinstance(self.drafter, mtp.MtpDrafter) else 0

    @property
    def prefill_hook(self):
        """None, or req -> Engine.prefill's on_hidden callback (the MTP drafter's admission)."""
        if not isinstance(self.drafter, mtp.MtpDrafter):
            return None
        return self._mtp_admission

    def _mtp_admission(self, req):
        """The on_hidden callback that runs req's prompt through the MTP head, chunk by chunk."""
        run = mtp.admit_executable(self.drafter)
        target = self.extra["target_engine"]

        def on_hidden(start: int, hidden, next_tokens: list[int]) -> None:
            C = hidden.shape[1]
            tokens = np.zeros((1, C), np.int32)
            tokens[0, :len(next_tokens)] = next_tokens
            # MTP rows write positions start + 1 .. start + n, its recursive drafts up to k - 1 more
            target.reserve(req.slot, start + len(next_tokens) + self.drafter.k)
            host = dict(next_tokens=tokens, start=np.full((1,), start, np.int32),
                        n=np.full((1,), len(next_tokens), np.int32), tables=target.block_tables[req.slot][None],
                        slot=np.full((1,), req.slot, np.int32))
            self.dstate = run(self.dparams, self.dstate, hidden, **jax.device_put(host))
        return on_hidden

    def admit(self, req) -> None:
        """Called after the target prefilled req (req.generated holds its first token)."""
        if isinstance(self.drafter, (NoDrafter, mtp.MtpDrafter)):
            return  # nothing to draft from / drafted during the prefill (prefill_hook)
        if isinstance(self.drafter, NgramDrafter):
            self.dstate = self.drafter.admit(self.dstate, req.slot, req.prompt + req.generated)
        elif isinstance(self.drafter, ReplayDrafter):
            self.dstate = self.drafter.admit(self.dstate, req.slot, list(self.replay[req.index]), len(req.generated))
        else:
            eng = self.draft_engine
            eng.acquire_slot(req.slot)
            eng.prefill(req.slot, req.prompt)
            self.dstate = {"caches": eng.caches}

    def release(self, req) -> None:
        if self.draft_engine is not None and req.slot in self.draft_engine.slot_pages:
            self.draft_engine.release_slot(req.slot)

    def reserve(self, req, num_tokens: int) -> None:
        """Pages for positions [0, num_tokens) in the draft model's own cache, if it has one."""
        if self.draft_engine is not None:
            self.draft_engine.reserve(req.slot, num_tokens)

    def aux_tables(self):
        """[S+1, Pa] device block tables the drafter writes (the draft model's), or None: the
        round then hands the drafter the target's tables (MTP; unused by ngram and replay)."""
        if self.draft_engine is None:
            return None
        self.draft_engine.sync_tables()
        return self.draft_engine.state.block_tables

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
    """The static (jit-keying) drafter proposing k tokens for a target engine configured by ecfg
    (method None: plain decoding)."""
    if method is None:
        return NoDrafter(k)
    if method == "ngram":
        return NgramDrafter(k=k, n_min=prompt_lookup[0], n_max=prompt_lookup[1],
                            history_len=ecfg.max_model_len + k + 1)
    if method == "replay":  # a fixed reference length, so references of any length share executables
        return ReplayDrafter(k=k, vocab_size=model.config.vocab_size, ref_len=ecfg.max_model_len + k + 1)
    from jaxspec import ops

    if method == "mtp":
        return mtp.MtpDrafter(k=k, cfg=model.config, num_layers=len(model.params["mtp"]["layers"]),
                              max_model_len=ecfg.max_model_len, kernels=ops.resolve_kernels(model.kernels))
    return DraftModelDrafter(k=k, cfg=draft_model.config, ecfg=draft_engine_config(ecfg, draft_model, k),
                             kernels=ops.resolve_kernels(draft_model.kernels))


def make_session(model, engine, spec, requests, k: int) -> Session:
    """The drafter session for a generate call (spec None: plain decoding); drafters propose k
    tokens (spec's k, or k_max when the model pads every k to its maximum)."""
    if spec is None:
        return Session(NoDrafter(k))
    num_slots = engine.ecfg.max_num_seqs + 1
    drafter = make_drafter(spec.method, model, engine.ecfg, k, draft_model=spec.draft_model,
                           prompt_lookup=(spec.prompt_lookup_min, spec.prompt_lookup_max))
    if spec.method == "ngram":
        return Session(drafter, dstate=drafter.init_state(num_slots))
    if spec.method == "replay":
        dparams = {"alpha": jnp.float32(spec.replay_alpha), "seed": jnp.uint32(spec.replay_seed)}
        return Session(drafter, dparams=dparams, dstate=drafter.init_state(num_slots), replay=spec.replay_tokens)
    if spec.method == "mtp":
        from jaxspec import cache

        plan = {**engine.memory_plan, "mtp_kv": mtp.state_bytes(drafter, engine.ecfg, model.dtype)}
        budget = model.memory_budget if model.memory_budget is not None else cache.device_memory_bytes()
        cache.check_budget(plan, budget)  # refuse before allocating the MTP pools
        return Session(drafter, dparams=mtp.draft_params(model.params),
                       dstate=mtp.init_state(drafter, engine.ecfg, model.dtype), extra={"target_engine": engine})
    draft_engine = spec.draft_model.engine_for(drafter.ecfg)
    return Session(drafter, dparams=spec.draft_model.params, dstate={"caches": draft_engine.caches},
                   draft_engine=draft_engine)
