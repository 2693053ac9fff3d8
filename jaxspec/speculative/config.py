"""`SpeculativeConfig`: which drafter proposes tokens and how many per round."""

from __future__ import annotations

import numbers
from dataclasses import dataclass

METHODS = ("ngram", "draft_model", "mtp", "eagle3", "dflash", "replay")
DYNAMIC_K_METHODS = ("ngram", "draft_model", "replay")  # drafters that draft at the start of the round
TAP_METHODS = {"eagle3": "speculative/eagle3.py", "dflash": "speculative/dflash.py"}  # drafters reading taps


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding settings.

    method: "ngram" (prompt lookup over each request's prompt + generated tokens, on device),
      "draft_model" (a smaller jaxspec Model with the same vocabulary), "mtp" (the target's own
      multi-token-prediction head, mtp.* weights, as Qwen3.5 / Qwen3-Next ship), "eagle3" (an EAGLE-3
      head reading three taps of the target, chain drafting), "dflash" (a DFlash block drafter reading
      taps of the target, one non-causal forward per round, k <= block_size - 1), or "replay" (a measurement
      tool: proposes `replay_tokens[i]`, the reference continuation of prompt i, with each token
      corrupted with probability 1 - replay_alpha, seeded; alpha = 1 accepts everything a greedy
      target would, alpha = 0 nothing).
    num_speculative_tokens: k, draft tokens per round (>= 1).
    draft_model: "draft_model": a jaxspec Model; "eagle3" / "dflash": a checkpoint directory in the
      published layout, a head loaded with jaxspec.speculative.<method>.load, or "demo-<method>"
      (paths and names are loaded here, once).
    dynamic_k: True makes num_speculative_tokens the largest k: each dispatch runs the k bucket
      (powers of two below k, and k) with the most expected tokens per unit of round cost, from the
      acceptance of earlier rounds (docs/speculation.md#dynamic-k). Drafters that draft at the
      start of the round only: ngram, draft_model, replay.
    dynamic_k_cost: the round cost model of dynamic k: None measures each bucket's dispatch time
      once per request bucket (all-padding rows, cached per process); c >= 0 assumes a round at k
      costs 1 + c * k rounds without drafts.
    """

    method: str
    num_speculative_tokens: int
    draft_model: object | None = None
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    replay_tokens: tuple[tuple[int, ...], ...] | None = None
    replay_alpha: float = 1.0
    replay_seed: int = 0
    max_num_speculative_tokens: int = 16
    dynamic_k: bool = False
    dynamic_k_cost: float | None = None

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"method={self.method!r} is not a speculative method; valid: {', '.join(METHODS)}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or not 1 <= k <= self.max_num_speculative_tokens:
            raise ValueError(f"num_speculative_tokens={k!r} must be an integer in "
                             f"[1, {self.max_num_speculative_tokens}] (max_num_speculative_tokens)")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min={self.prompt_lookup_min}, prompt_lookup_max="
                             f"{self.prompt_lookup_max}: need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.method == "draft_model" and self.draft_model is None:
            raise ValueError("method='draft_model' needs draft_model=<a jaxspec Model>, e.g. jaxspec.load(path)")
        if self.method in TAP_METHODS:
            import importlib

            from jaxspec.speculative import heads

            module = importlib.import_module(f"jaxspec.speculative.{self.method}")
            object.__setattr__(self, "draft_model", heads.resolve(self.method, self.draft_model, module.load))
        if self.method == "replay":
            if self.replay_tokens is None:
                raise ValueError("method='replay' needs replay_tokens: one reference continuation per prompt")
            if not 0.0 <= self.replay_alpha <= 1.0:
                raise ValueError(f"replay_alpha={self.replay_alpha} must be in [0, 1]")
            object.__setattr__(self, "replay_tokens", tuple(tuple(int(t) for t in r) for r in self.replay_tokens))
        self._check_dynamic_k()

    def _check_dynamic_k(self) -> None:
        if not isinstance(self.dynamic_k, bool):
            raise ValueError(f"dynamic_k={self.dynamic_k!r} must be True or False")
        cost = self.dynamic_k_cost
        if cost is not None and (isinstance(cost, bool) or not isinstance(cost, numbers.Real) or not cost >= 0):
            raise ValueError(f"dynamic_k_cost={cost!r} must be None (measured) or a number >= 0 (a round at k "
                             f"costs 1 + dynamic_k_cost * k rounds without drafts)")
        if not self.dynamic_k:
            if cost is not None:
                raise ValueError(f"dynamic_k_cost={cost!r} is a setting of dynamic k; pass dynamic_k=True too")
            return
        if self.method not in DYNAMIC_K_METHODS:
            raise ValueError(f"dynamic_k=True does not support method={self.method!r}: it drafts the next round's "
                             f"tokens in the previous round, k of them, before the next k is known; valid: "
                             f"{', '.join(DYNAMIC_K_METHODS)} (docs/speculation.md#dynamic-k)")
        if self.num_speculative_tokens < 2:
            raise ValueError(f"dynamic_k=True with num_speculative_tokens={self.num_speculative_tokens} leaves one "
                             f"k to choose; num_speculative_tokens is the largest k, use >= 2")

    @property
    def k_buckets(self) -> tuple[int, ...]:
        """The ks a round may run: dynamic.k_buckets(k) with dynamic_k, else (k,)."""
        from jaxspec.speculative.dynamic import k_buckets

        return k_buckets(self.k) if self.dynamic_k else (self.k,)

    @property
    def k(self) -> int:
        return self.num_speculative_tokens


def check_speculative(spec, model, num_prompts: int | None = None) -> None:
    """Validate a SpeculativeConfig against the target model (and the prompt count, for replay)."""
    if not isinstance(spec, SpeculativeConfig):
        raise ValueError(f"speculative={spec!r} must be a jaxspec.SpeculativeConfig or None")
    limit = getattr(model, "max_num_speculative_tokens", 0)
    if limit and spec.k > limit:
        raise ValueError(f"num_speculative_tokens={spec.k} is above this model's configured maximum "
                         f"max_num_speculative_tokens={limit}; use k <= {limit} or load with a larger maximum")
    if spec.dynamic_k and model.k_mode == "pad_to_max":
        raise ValueError("dynamic_k=True chooses among per-k executables, but k_mode='pad_to_max' runs every k "
                         "with the k_max one; load with k_mode='per_k'")
    from jaxspec.speculative.session import SESSIONS

    SESSIONS[spec.method].check(spec, model, num_prompts)  # the method's own requirements
