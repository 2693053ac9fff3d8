"""Host side of a drafter: one class per speculative method, registered by name in `SESSIONS`. A
class holds everything the rest of jaxspec needs to know about its method, so a new drafter is its
device code (propose / commit, speculative/drafters.py) plus one class here:

    drafter(model, ecfg, k, spec_fields) -> the static, hashable drafter (a jit key)
    create(model, engine, drafter, spec) -> a session: device params and state for one generate call
    abstract(model, ecfg, drafter, draft_model) -> (dparams, dstate, aux tables) as shapes, for precompile
    admission_buckets(...) / lower_admission(...) -> the method's extra executables and their lowering
    admit / release / reserve / aux_tables / sync / lookahead / prefill_hook -> the loop's hooks

The loop (jaxspec/loop.py) and the precompiler (jaxspec/compile.py) never test a method's name.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import sharding
from jaxspec.config import EngineConfig
from jaxspec.speculative import dflash, eagle3, mtp
from jaxspec.speculative.drafters import DraftModelDrafter, NgramDrafter, NoDrafter, ReplayDrafter, set_slot


def _shape(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


@dataclass
class Session:
    """Plain decoding (the NoDrafter; k = the inert columns of a plain step) and the defaults every
    method shares: nothing to admit, release or reserve; the round hands the drafter the target's
    block tables."""

    drafter: object  # the static drafter dataclass
    dparams: object = None
    dstate: object = None
    extra: dict = field(default_factory=dict)
    plain_prefill = True  # class attribute: admission prefills through the engine's plain prefill

    # ---- construction ------------------------------------------------------------------------
    @classmethod
    def check(cls, spec, model, num_prompts: int | None) -> None:
        """Refuse, with an error naming the value, a SpeculativeConfig this target cannot serve."""

    @classmethod
    def memory(cls, model, ecfg: EngineConfig, k: int, draft_model) -> dict[str, int]:
        """Bytes the method allocates beside the target engine (the memory plan's extra entries)."""
        return {}

    @classmethod
    def make_drafter(cls, model, ecfg: EngineConfig, k: int, *, prompt_lookup=(1, 4), draft_model=None):
        return NoDrafter(k)

    @classmethod
    def create(cls, model, engine, drafter, spec) -> Session:
        return cls(drafter)

    @classmethod
    def abstract(cls, model, ecfg: EngineConfig, drafter, draft_model) -> tuple:
        """(dparams, dstate, aux tables) shapes exactly as create() and aux_tables() give them."""
        return None, None, None

    @classmethod
    def admission_buckets(cls, model, k: int, engine_k: int, chunk: int, draft_model) -> list[dict]:
        """The method's own executables besides its rounds, as compile.Bucket fields ("admit" is
        named admit[<method>]; k and method default to the round's)."""
        return []

    @classmethod
    def lower_admission(cls, model, ecfg: EngineConfig, bucket, draft_model):
        raise ValueError(f"{bucket.name} is not an executable of this method")

    # ---- the loop's hooks ----------------------------------------------------------------------
    @property
    def lookahead(self) -> int:
        """Positions past a round's verify span the drafter writes in the target's KV pages."""
        return 0

    @property
    def prefill_hook(self):
        """None, or req -> Engine.prefill's on_hidden callback (chunk by chunk prompt hidden states)."""
        return None

    @property
    def taps(self) -> tuple[int, ...]:
        """Target layers whose hidden states the prefill hands to prefill_hook (() = the final hidden)."""
        return ()

    def admit(self, req) -> None:
        """Called after the target prefilled req (req.generated holds its first token)."""

    def release(self, req) -> None:
        """Called when req's slot is freed."""

    def reserve(self, req, num_tokens: int) -> None:
        """Pages for positions [0, num_tokens) in the drafter's own caches, if it has any."""

    def aux_tables(self):
        """[S+1, Pa] device block tables the drafter writes, or None for the target's own."""
        return None

    def sync(self) -> None:
        """Take back what a round donated (the drafter state is already self.dstate)."""


def _history_len(ecfg: EngineConfig) -> int:
    """Tokens a per-slot history holds: the longest request plus one round's emitted tokens at the
    engine's k_max. Sized by the engine, not the round's k, so that rounds of every k up to k_max
    share one drafter state (dynamic k, docs/speculation.md#dynamic-k)."""
    return ecfg.max_model_len + ecfg.max_num_speculative_tokens + 1


class _SlotStateSession(Session):
    """Drafters whose device state is a few int32 arrays indexed by slot (ngram, replay): one
    `set_slot` executable writes an admitted request's row."""

    @classmethod
    def abstract(cls, model, ecfg, drafter, draft_model):
        return cls._abstract_params(), jax.eval_shape(lambda: drafter.init_state(ecfg.max_num_seqs + 1)), None

    @classmethod
    def _abstract_params(cls):
        return None

    @classmethod
    def admission_buckets(cls, model, k, engine_k, chunk, draft_model):
        return [dict(name="admit", num_reqs=1, query_len=0, engine_k=engine_k)]

    @classmethod
    def lower_admission(cls, model, ecfg, bucket, draft_model):
        drafter = cls.make_drafter(model, ecfg, bucket.k)
        dstate = jax.eval_shape(lambda: drafter.init_state(ecfg.max_num_seqs + 1))
        values = {name: _shape(x.shape[1:], jnp.int32) for name, x in dstate.items()}
        return set_slot.lower(*sharding.abstract((dstate, _shape((), jnp.int32), values), model.config.mesh))


class NgramSession(_SlotStateSession):
    """Prompt lookup over each request's prompt + generated tokens (history per slot)."""

    @classmethod
    def make_drafter(cls, model, ecfg, k, *, prompt_lookup=(1, 4), draft_model=None):
        return NgramDrafter(k=k, n_min=prompt_lookup[0], n_max=prompt_lookup[1], history_len=_history_len(ecfg))

    @classmethod
    def create(cls, model, engine, drafter, spec):
        return cls(drafter, dstate=sharding.put(drafter.init_state(engine.ecfg.max_num_seqs + 1), model.config.mesh))

    def admit(self, req) -> None:
        self.dstate = self.drafter.admit(self.dstate, req.slot, req.prompt + req.generated)


class ReplaySession(_SlotStateSession):
    """A measurement tool: a reference continuation per request, corrupted with probability 1 - alpha."""

    @classmethod
    def make_drafter(cls, model, ecfg, k, *, prompt_lookup=(1, 4), draft_model=None):
        # a fixed reference length, so references of any length share executables
        return ReplayDrafter(k=k, vocab_size=model.config.vocab_size, ref_len=_history_len(ecfg))

    @classmethod
    def check(cls, spec, model, num_prompts):
        if num_prompts is not None and len(spec.replay_tokens) != num_prompts:
            raise ValueError(f"replay_tokens has {len(spec.replay_tokens)} continuations for {num_prompts} prompts")

    @classmethod
    def _abstract_params(cls):
        return {"alpha": _shape((), jnp.float32), "seed": _shape((), jnp.uint32)}

    @classmethod
    def create(cls, model, engine, drafter, spec):
        mesh = model.config.mesh
        dparams = sharding.put({"alpha": np.float32(spec.replay_alpha), "seed": np.uint32(spec.replay_seed)}, mesh)
        dstate = sharding.put(drafter.init_state(engine.ecfg.max_num_seqs + 1), mesh)
        return cls(drafter, dparams=dparams, dstate=dstate, extra={"replay": spec.replay_tokens})

    def admit(self, req) -> None:
        self.dstate = self.drafter.admit(self.dstate, req.slot, list(self.extra["replay"][req.index]),
                                         len(req.generated))


def draft_engine_config(target_ecfg: EngineConfig, draft) -> EngineConfig:
    """The draft model's engine: the target's slots and lengths, 1 + k_max state slots (the target
    engine's k_max, so rounds of every k up to it share the draft caches) and one conv window per
    state slot (it advances one token per step)."""
    return EngineConfig(max_num_seqs=target_ecfg.max_num_seqs, max_model_len=target_ecfg.max_model_len,
                        page_size=draft.page_size, prefill_chunk=draft.prefill_chunk,
                        max_num_speculative_tokens=target_ecfg.max_num_speculative_tokens, conv_per_state_slot=True,
                        request_buckets=target_ecfg.request_buckets)


class DraftModelSession(Session):
    """A smaller model with its own engine (caches, pages, slots mirroring the target's)."""

    @classmethod
    def check(cls, spec, model, num_prompts):
        draft = spec.draft_model
        if not hasattr(draft, "config") or not hasattr(draft, "params"):
            raise ValueError(f"draft_model={draft!r} is not a jaxspec Model (load it with jaxspec.load)")
        if draft.config.mesh != model.config.mesh:
            raise ValueError(f"the draft model is loaded with tensor_parallel_size={sharding.tp_size(draft.config)}, "
                             f"the target with {sharding.tp_size(model.config)}; load both on the same devices "
                             f"(the same tensor_parallel_size)")
        if draft.config.vocab_size != model.config.vocab_size:
            raise ValueError(f"draft model vocab_size={draft.config.vocab_size} differs from the target's "
                             f"vocab_size={model.config.vocab_size}; draft and target must share a vocabulary")

    @classmethod
    def make_drafter(cls, model, ecfg, k, *, prompt_lookup=(1, 4), draft_model=None):
        from jaxspec import ops

        return DraftModelDrafter(k=k, cfg=draft_model.config, ecfg=draft_engine_config(ecfg, draft_model),
                                 kernels=ops.resolve_kernels(draft_model.kernels))

    @classmethod
    def memory(cls, model, ecfg, k, draft_model):
        from jaxspec.engine import memory_plan

        plan = memory_plan(draft_model, draft_engine_config(ecfg, draft_model))
        return {f"draft_{name}": size for name, size in plan.items()}

    @classmethod
    def create(cls, model, engine, drafter, spec):
        from jaxspec import cache

        # target and draft together, before the draft engine allocates anything
        plan = {**engine.memory_plan, **cls.memory(model, engine.ecfg, drafter.k, spec.draft_model)}
        cache.check_budget(plan, cache.budget_of(model))
        draft_engine = spec.draft_model.engine_for(drafter.ecfg)
        return cls(drafter, dparams=spec.draft_model.params, dstate={"caches": draft_engine.caches},
                   extra={"engine": draft_engine})

    @classmethod
    def abstract(cls, model, ecfg, drafter, draft_model):
        from jaxspec import cache

        dstate = {"caches": cache.cache_shapes(draft_model.config, drafter.ecfg, draft_model.dtype)}
        return draft_model.params, dstate, _shape((ecfg.max_num_seqs + 1, drafter.ecfg.pages_per_seq), jnp.int32)

    @classmethod
    def admission_buckets(cls, model, k, engine_k, chunk, draft_model):
        return [dict(name="draft_allocate", num_reqs=0, query_len=0, engine_k=engine_k),
                dict(name="draft_prefill", num_reqs=1, query_len=draft_model.prefill_chunk, engine_k=engine_k)]

    @classmethod
    def lower_admission(cls, model, ecfg, bucket, draft_model):
        from jaxspec import cache
        from jaxspec.compile import lower_prefill

        draft_ecfg = draft_engine_config(ecfg, draft_model)
        if bucket.name == "draft_allocate":
            return cache.allocate_executable(draft_model.config, draft_ecfg, jnp.dtype(draft_model.dtype)).lower()
        return lower_prefill(draft_model, draft_ecfg, bucket.query_len)

    @property
    def engine(self):
        return self.extra["engine"]

    def admit(self, req) -> None:
        self.engine.acquire_slot(req.slot)
        self.engine.prefill(req.slot, req.prompt)
        self.dstate = {"caches": self.engine.caches}

    def release(self, req) -> None:
        if req.slot in self.engine.slot_pages:
            self.engine.release_slot(req.slot)

    def reserve(self, req, num_tokens: int) -> None:
        self.engine.reserve(req.slot, num_tokens)

    def aux_tables(self):
        self.engine.sync_tables()
        return self.engine.state.block_tables

    def sync(self) -> None:
        self.engine.caches = self.dstate["caches"]


class MtpSession(Session):
    """The target's own MTP head: its prompt rows run at admission from the prefill's hidden
    states; each round drafts in commit from the verify's hidden states (speculative/mtp.py)."""

    plain_prefill = False  # the prefill that hands over hidden states (prefill_hidden) replaces it

    @classmethod
    def check(cls, spec, model, num_prompts):
        if "mtp" not in getattr(model, "params", {}):
            raise ValueError("method='mtp' needs a target with an MTP head (mtp.* weights, as Qwen3.5 and "
                             "Qwen3-Next checkpoints ship); this model has none. Use 'ngram' or 'draft_model' instead")

    @classmethod
    def make_drafter(cls, model, ecfg, k, *, prompt_lookup=(1, 4), draft_model=None):
        from jaxspec import ops

        return mtp.MtpDrafter(k=k, cfg=model.config, num_layers=len(model.params["mtp"]["layers"]),
                              max_model_len=ecfg.max_model_len, kernels=ops.resolve_kernels(model.kernels))

    @classmethod
    def memory(cls, model, ecfg, k, draft_model):
        return {"mtp_kv": mtp.state_bytes(cls.make_drafter(model, ecfg, k), ecfg, model.dtype)}

    @classmethod
    def create(cls, model, engine, drafter, spec):
        from jaxspec import cache

        plan = {**engine.memory_plan, **cls.memory(model, engine.ecfg, drafter.k, None)}
        cache.check_budget(plan, cache.budget_of(model))  # refuse before allocating the MTP pools
        return cls(drafter, dparams=mtp.draft_params(model.params),
                   dstate=mtp.init_state(drafter, engine.ecfg, model.dtype), extra={"target_engine": engine})

    @classmethod
    def abstract(cls, model, ecfg, drafter, draft_model):
        return mtp.draft_params(model.params), cls._state_shapes(drafter, ecfg, model.dtype), None

    @staticmethod
    def _state_shapes(drafter, ecfg, dtype) -> dict:
        """Abstract MTP drafter state, as mtp.init_state allocates it."""
        return {"kv": mtp.kv_shapes(drafter.cfg, ecfg.total_pages, ecfg.page_size, drafter.num_layers, dtype),
                "drafts": _shape((ecfg.max_num_seqs + 1, drafter.k), jnp.int32)}

    @classmethod
    def admission_buckets(cls, model, k, engine_k, chunk, draft_model):
        # the prefill hands its hidden states to the MTP head's prompt pass
        return [dict(name="prefill_hidden", num_reqs=1, query_len=chunk, engine_k=engine_k, k=0, method=None),
                dict(name="admit", num_reqs=1, query_len=chunk, engine_k=engine_k)]

    @classmethod
    def lower_admission(cls, model, ecfg, bucket, draft_model):
        drafter = cls.make_drafter(model, ecfg, bucket.k, draft_model=draft_model)
        C, i32 = bucket.query_len, jnp.int32
        width = model.config.hidden_size * max(len(getattr(drafter, "taps", ())), 1)
        hidden = _shape((1, C, width), model.dtype)  # the prefill's final hidden states, or its taps
        dparams, dstate, _ = cls.abstract(model, ecfg, drafter, draft_model)
        kwargs = dict(next_tokens=_shape((1, C), i32), start=_shape((1,), i32), n=_shape((1,), i32),
                      tables=_shape((1, ecfg.pages_per_seq), i32), slot=_shape((1,), i32))
        args, kwargs = sharding.abstract(((dparams, dstate, hidden), kwargs), model.config.mesh)
        return mtp.admit_executable(drafter).lower(*args, **kwargs)

    @property
    def lookahead(self) -> int:
        return self.drafter.k  # the recursive drafting rows reach k - 1 past the verify span

    @property
    def prefill_hook(self):
        return self._admission

    def _admission(self, req):
        """The on_hidden callback that runs req's prompt through the MTP head, chunk by chunk."""
        run = mtp.admit_executable(self.drafter)
        target = self.extra["target_engine"]

        def on_hidden(start: int, hidden, next_tokens: list[int]) -> None:
            C = hidden.shape[1]
            tokens = np.zeros((1, C), np.int32)
            tokens[0, :len(next_tokens)] = next_tokens
            # rows write positions start .. start + n - 1, the drafting after them up to lookahead more
            # (never past the request's limit: those rows write only the null page). Loop.start
            # reserved these pages already; this covers a caller that did not.
            target.reserve(req.slot, min(start + len(next_tokens) + self.lookahead, req.limit))
            host = dict(next_tokens=tokens, start=np.full((1,), start, np.int32),
                        n=np.full((1,), len(next_tokens), np.int32), tables=target.block_tables[req.slot][None],
                        slot=np.full((1,), req.slot, np.int32))
            self.dstate = run(self.dparams, self.dstate, hidden, **sharding.put(host, self.drafter.cfg.mesh))
        return on_hidden


class _TapSession(MtpSession):
    """A drafter that reads taps of the target (EAGLE-3, DFlash): MTP's schedule (prompt rows at
    admission from the prefill, drafting in commit) with its own head, given by draft_model (a
    heads.Head: SpeculativeConfig resolves paths and demo names), and its own paged KV pools on the
    target's page ids. The prefill that hands the taps over is prefill_taps."""

    module = None  # speculative/eagle3.py or speculative/dflash.py

    @classmethod
    def check(cls, spec, model, num_prompts):
        cls.module.check_target(spec.draft_model, model.config)

    @classmethod
    def memory(cls, model, ecfg, k, draft_model):
        drafter = cls.make_drafter(model, ecfg, k, draft_model=draft_model)
        name = draft_model.method
        return {f"{name}_weights": draft_model.nbytes(model.dtype),
                f"{name}_kv": mtp.state_bytes(drafter, ecfg, model.dtype)}

    @classmethod
    def create(cls, model, engine, drafter, spec):
        from jaxspec import cache

        plan = {**engine.memory_plan, **cls.memory(model, engine.ecfg, drafter.k, spec.draft_model)}
        cache.check_budget(plan, cache.budget_of(model))  # refuse before allocating the head and its pools
        return cls(drafter, dparams=cls.module.draft_params(spec.draft_model, model.params, model.dtype),
                   dstate=mtp.init_state(drafter, engine.ecfg, model.dtype), extra={"target_engine": engine})

    @classmethod
    def abstract(cls, model, ecfg, drafter, draft_model):
        dparams = cls.module.draft_params(draft_model, model.params, model.dtype, abstract=True)
        return dparams, cls._state_shapes(drafter, ecfg, model.dtype), None

    @classmethod
    def admission_buckets(cls, model, k, engine_k, chunk, draft_model):
        # k = 0: one prefill executable serves every k (it depends on the taps only)
        return [dict(name="prefill_taps", num_reqs=1, query_len=chunk, engine_k=engine_k, k=0),
                dict(name="admit", num_reqs=1, query_len=chunk, engine_k=engine_k)]

    @classmethod
    def lower_admission(cls, model, ecfg, bucket, draft_model):
        from jaxspec.compile import lower_prefill

        if bucket.name == "prefill_taps":
            taps = cls.make_drafter(model, ecfg, 1, draft_model=draft_model).taps
            return lower_prefill(model, ecfg, bucket.query_len, with_hidden=True, taps=taps)
        return super().lower_admission(model, ecfg, bucket, draft_model)

    @property
    def taps(self) -> tuple[int, ...]:
        return self.drafter.taps


class Eagle3Session(_TapSession):
    """EAGLE-3 (speculative/eagle3.py): chain drafting from three taps, one draft layer."""

    module = eagle3

    @classmethod
    def make_drafter(cls, model, ecfg, k, *, prompt_lookup=(1, 4), draft_model=None):
        from jaxspec import ops

        head = draft_model.config
        return eagle3.Eagle3Drafter(k=k, cfg=head.layer, num_layers=1, max_model_len=ecfg.max_model_len,
                                    kernels=ops.resolve_kernels(model.kernels), head=head,
                                    taps=head.taps(model.config))


class DFlashSession(_TapSession):
    """DFlash (speculative/dflash.py): one non-causal block forward per round from the taps."""

    module = dflash

    @classmethod
    def check(cls, spec, model, num_prompts):
        super().check(spec, model, num_prompts)
        limit = spec.draft_model.config.block_size - 1
        if spec.k > limit:
            raise ValueError(f"num_speculative_tokens={spec.k} exceeds this DFlash drafter's block_size - 1 = "
                             f"{limit} (dflash_config.block_size={limit + 1}); use k <= {limit}")
        if model.k_mode == "pad_to_max" and model.max_num_speculative_tokens > limit:
            raise ValueError(f"k_mode='pad_to_max' drafts max_num_speculative_tokens="
                             f"{model.max_num_speculative_tokens} tokens per round, more than this DFlash "
                             f"drafter's block_size - 1 = {limit}; load with max_num_speculative_tokens <= {limit}")

    @classmethod
    def make_drafter(cls, model, ecfg, k, *, prompt_lookup=(1, 4), draft_model=None):
        from jaxspec import ops

        head = draft_model.config
        return dflash.DFlashDrafter(k=k, cfg=head.layer, num_layers=head.layer.num_hidden_layers,
                                    max_model_len=ecfg.max_model_len, kernels=ops.resolve_kernels(model.kernels),
                                    head=head, tied=model.config.tie_word_embeddings)

    @property
    def lookahead(self) -> int:
        return self.drafter.head.block_size  # the block after the verified tokens reaches this far past the span

    def reserve(self, req, num_tokens: int) -> None:
        """The loop caps a request's pages at its last position, but a block that drafts for a
        position before it is non-causal: its rows past that position must have pages too, or they
        would meet other rows' K/V in the shared null page."""
        self.extra["target_engine"].reserve(req.slot, num_tokens + self.lookahead)


SESSIONS: dict[str | None, type[Session]] = {None: Session, "ngram": NgramSession, "replay": ReplaySession,
                                             "draft_model": DraftModelSession, "mtp": MtpSession,
                                             "eagle3": Eagle3Session, "dflash": DFlashSession}


def make_drafter(method: str | None, model, ecfg: EngineConfig, k: int, *, prompt_lookup=(1, 4), draft_model=None):
    """The static (jit-keying) drafter proposing k tokens for a target engine configured by ecfg
    (method None: plain decoding, k inert columns)."""
    return SESSIONS[method].make_drafter(model, ecfg, k, prompt_lookup=prompt_lookup, draft_model=draft_model)


def make_session(model, engine, spec, requests, k: int) -> Session:
    """The drafter session for a generate call (spec None: plain decoding); drafters propose k
    tokens (spec's k, or k_max when the model pads every k to its maximum)."""
    method = None if spec is None else spec.method
    lookup = (1, 4) if spec is None else (spec.prompt_lookup_min, spec.prompt_lookup_max)
    drafter = make_drafter(method, model, engine.ecfg, k, prompt_lookup=lookup,
                           draft_model=None if spec is None else spec.draft_model)
    return SESSIONS[method].create(model, engine, drafter, spec)
