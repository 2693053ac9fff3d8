"""Frozen, hashable configuration dataclasses.

`ModelConfig` describes one model family instance (built from a Hugging Face config.json); it is a
static argument of every jitted function, so it must stay hashable. `EngineConfig` holds the sizes
that define the caches and the bucket table.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

FULL = "full_attention"
LINEAR = "linear_attention"

# model_type -> family. Wrapped multimodal configs keep their text fields under "text_config".
_FAMILIES = {
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3",
    "qwen3_5": "qwen3_5",
    "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe": "qwen3_5",
    "qwen3_5_moe_text": "qwen3_5",
    "qwen3_next": "qwen3_next",
}
SUPPORTED_MODEL_TYPES = tuple(sorted(_FAMILIES))


class ConfigError(ValueError):
    """A config.json that jaxspec cannot use; the message names the field."""


@dataclass(frozen=True)
class ModelConfig:
    model_type: str  # the HF model_type of the text model (after unwrapping)
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    partial_rotary_factor: float = 1.0
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    max_position_embeddings: int = 32768
    # Hybrid families: per-layer mixer, gated attention, zero-centred (1 + w) RMSNorm.
    layer_types: tuple[str, ...] = ()
    attn_output_gate: bool = False
    zero_centered_norm: bool = False
    # Gated DeltaNet (linear attention) sizes.
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    # Mixture of experts; mlp_kinds[i] is "dense" or "moe".
    mlp_kinds: tuple[str, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    # Native multi-token-prediction head (mtp.* weights); 0 when absent.
    mtp_num_hidden_layers: int = 0
    # Checkpoint facts used by the weight loader only.
    wrapped: bool = False  # multimodal wrapper: text weights under model.language_model.*
    torch_dtype: str = "float32"
    eos_token_ids: tuple[int, ...] = ()
    # The device mesh the params and caches are sharded over (jaxspec/sharding.py); None = one
    # device. A static field like the rest, so every executable is keyed on the mesh.
    mesh: Any = None

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "intermediate_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}={value!r} must be a positive integer")
        if self.model_type not in _FAMILIES:
            raise ConfigError(f"model_type={self.model_type!r} is not supported; "
                              f"valid: {', '.join(SUPPORTED_MODEL_TYPES)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                              f"num_key_value_heads={self.num_key_value_heads}")
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            raise ConfigError(f"partial_rotary_factor={self.partial_rotary_factor} must be in (0, 1]")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(f"layer_types has {len(self.layer_types)} entries, "
                              f"num_hidden_layers={self.num_hidden_layers}")
        bad = [t for t in self.layer_types if t not in (FULL, LINEAR)]
        if bad:
            raise ConfigError(f"layer_types contains {bad[0]!r}; valid: {FULL!r}, {LINEAR!r}")
        if len(self.mlp_kinds) != self.num_hidden_layers:
            raise ConfigError(f"mlp_kinds has {len(self.mlp_kinds)} entries, "
                              f"num_hidden_layers={self.num_hidden_layers}")
        if "moe" in self.mlp_kinds:
            if self.num_experts < 1 or not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ConfigError(f"num_experts={self.num_experts}, num_experts_per_tok="
                                  f"{self.num_experts_per_tok}: need 1 <= num_experts_per_tok <= num_experts")
            if self.moe_intermediate_size < 1:
                raise ConfigError(f"moe_intermediate_size={self.moe_intermediate_size} must be >= 1")
        if LINEAR in self.layer_types:
            for name in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                         "linear_value_head_dim", "linear_conv_kernel_dim"):
                if getattr(self, name) < 1:
                    raise ConfigError(f"{name}={getattr(self, name)} must be >= 1 for linear_attention layers")
            if self.linear_num_value_heads % self.linear_num_key_heads:
                raise ConfigError(f"linear_num_value_heads={self.linear_num_value_heads} must be a multiple "
                                  f"of linear_num_key_heads={self.linear_num_key_heads}")

    # ---- derived sizes -------------------------------------------------------------------------
    @property
    def family(self) -> str:
        return _FAMILIES[self.model_type]

    @property
    def is_hybrid(self) -> bool:
        return LINEAR in self.layer_types

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)

    @property
    def gdn_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def gdn_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def gdn_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def gdn_conv_dim(self) -> int:
        return 2 * self.gdn_key_dim + self.gdn_value_dim

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    # ---- construction from HF ------------------------------------------------------------------
    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> ModelConfig:
        """Build from a parsed HF config.json (qwen3, qwen3_moe, qwen3_5[_text], qwen3_5_moe[_text],
        qwen3_next). Raises ConfigError naming the offending field."""
        if not isinstance(config, dict):
            raise ConfigError(f"config must be a dict parsed from config.json, got {type(config).__name__}")
        outer_type = config.get("model_type")
        if outer_type not in _FAMILIES:
            raise ConfigError(f"model_type={outer_type!r} is not supported; valid: {', '.join(SUPPORTED_MODEL_TYPES)}")
        wrapped = outer_type in ("qwen3_5", "qwen3_5_moe") and "text_config" in config
        text = dict(config["text_config"]) if wrapped else dict(config)
        model_type = text.get("model_type", outer_type)
        if wrapped and model_type == outer_type:
            model_type = outer_type + "_text"
        if model_type not in _FAMILIES:
            raise ConfigError(f"text_config.model_type={model_type!r} is not supported")
        # Outer-level fields that the wrapper keeps outside text_config.
        for key in ("tie_word_embeddings", "torch_dtype", "dtype", "eos_token_id"):
            if key not in text and key in config:
                text[key] = config[key]
        # The wrapper's lm_head is tied by the outer flag (what transformers reads), not text_config's.
        if wrapped and "tie_word_embeddings" in config:
            text["tie_word_embeddings"] = config["tie_word_embeddings"]
        return cls(**_fields_from_text(text, model_type, wrapped))


def _req(d: dict, name: str):
    if name not in d:
        raise ConfigError(f"config.json is missing required field {name!r}")
    return d[name]


def _rope(d: dict) -> tuple[float, float]:
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if rope and rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        raise ConfigError(f"rope_parameters.rope_type={rope.get('rope_type')!r} is not supported; valid: 'default'")
    theta = rope.get("rope_theta", d.get("rope_theta", 1_000_000.0))
    factor = rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    return float(theta), float(factor)


def _layer_types(d: dict, model_type: str, n: int) -> tuple[str, ...]:
    if _FAMILIES[model_type] == "qwen3":
        return (FULL,) * n
    if d.get("layer_types"):
        return tuple(d["layer_types"])
    interval = d.get("full_attention_interval", 4)
    if not isinstance(interval, int) or interval < 1:
        raise ConfigError(f"full_attention_interval={interval!r} must be a positive integer")
    return tuple(FULL if (i + 1) % interval == 0 else LINEAR for i in range(n))


def _mlp_kinds(d: dict, model_type: str, n: int) -> tuple[str, ...]:
    if model_type in ("qwen3", "qwen3_5", "qwen3_5_text"):
        return ("dense",) * n
    if model_type in ("qwen3_5_moe", "qwen3_5_moe_text"):
        return ("moe",) * n
    # qwen3_moe / qwen3_next: sparse on every decoder_sparse_step-th layer unless listed as mlp-only.
    step = d.get("decoder_sparse_step", 1)
    only = set(d.get("mlp_only_layers") or ())
    experts = _num_experts(d)
    return tuple("moe" if experts > 0 and step > 0 and (i + 1) % step == 0 and i not in only else "dense"
                 for i in range(n))


def _num_experts(d: dict) -> int:
    """transformers 5 writes qwen3_moe's expert count as num_local_experts (attribute_map alias)."""
    return d.get("num_experts", d.get("num_local_experts", 0)) or 0


def _eos(d: dict) -> tuple[int, ...]:
    eos = d.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def _fields_from_text(d: dict, model_type: str, wrapped: bool) -> dict[str, Any]:
    n = _req(d, "num_hidden_layers")
    heads = _req(d, "num_attention_heads")
    hidden = _req(d, "hidden_size")
    theta, factor = _rope(d)
    hybrid = _FAMILIES[model_type] != "qwen3"
    moe = model_type in ("qwen3_moe", "qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text")
    head_dim = d.get("head_dim") or (hidden // heads if isinstance(hidden, int) and isinstance(heads, int) else 0)
    fields = dict(
        model_type=model_type,
        vocab_size=_req(d, "vocab_size"),
        hidden_size=hidden,
        num_hidden_layers=n,
        num_attention_heads=heads,
        num_key_value_heads=d.get("num_key_value_heads", heads),
        head_dim=head_dim,
        intermediate_size=d.get("intermediate_size") or d.get("moe_intermediate_size") or 0,
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        partial_rotary_factor=factor,
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        attention_bias=bool(d.get("attention_bias", False)),
        max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
        layer_types=_layer_types(d, model_type, n) if isinstance(n, int) else (),
        attn_output_gate=hybrid and bool(d.get("attn_output_gate", True)),
        zero_centered_norm=hybrid,
        mlp_kinds=_mlp_kinds(d, model_type, n) if isinstance(n, int) else (),
        mtp_num_hidden_layers=int(d.get("mtp_num_hidden_layers", d.get("num_nextn_predict_layers", 0)) or 0),
        wrapped=wrapped,
        torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "float32"),
        eos_token_ids=_eos(d),
    )
    if hybrid:
        fields.update(
            linear_num_key_heads=_req(d, "linear_num_key_heads"),
            linear_num_value_heads=_req(d, "linear_num_value_heads"),
            linear_key_head_dim=_req(d, "linear_key_head_dim"),
            linear_value_head_dim=_req(d, "linear_value_head_dim"),
            linear_conv_kernel_dim=d.get("linear_conv_kernel_dim", 4),
        )
    if moe:
        fields.update(
            num_experts=_num_experts(d) or _req(d, "num_experts"),
            num_experts_per_tok=_req(d, "num_experts_per_tok"),
            moe_intermediate_size=_req(d, "moe_intermediate_size"),
            shared_expert_intermediate_size=int(d.get("shared_expert_intermediate_size", 0) or 0),
            # Qwen3.5-MoE always renormalises the top-k weights (the field is absent from its config).
            norm_topk_prob=bool(d.get("norm_topk_prob", True)) if model_type in ("qwen3_moe", "qwen3_next") else True,
        )
    return fields


# ------------------------------------------------------------------------------------------------
# Engine configuration: sizes that define caches and the executable bucket table.
# ------------------------------------------------------------------------------------------------

def default_request_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Powers of two up to max_num_seqs, always including max_num_seqs itself."""
    out, b = [], 1
    while b < max_num_seqs:
        out.append(b)
        b *= 2
    out.append(max_num_seqs)
    return tuple(out)


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 8
    max_model_len: int = 2048
    page_size: int = 16
    prefill_chunk: int = 64
    max_num_speculative_tokens: int = 0  # k_max: sizes GDN state slots (1+k_max per request) and conv windows
    num_pages: int | None = None  # None: enough for max_num_seqs requests of max_model_len
    conv_per_state_slot: bool = False  # draft engines: one conv window per GDN state slot (T = 1 steps)
    request_buckets: tuple[int, ...] = field(default=())

    def __post_init__(self):
        checks = {"max_num_seqs": 1, "max_model_len": 1, "page_size": 1, "prefill_chunk": 1,
                  "max_num_speculative_tokens": 0}
        for name, low in checks.items():
            value = getattr(self, name)
            if not isinstance(value, int) or value < low:
                raise ValueError(f"{name}={value!r} must be an integer >= {low}")
        if not self.request_buckets:
            object.__setattr__(self, "request_buckets", default_request_buckets(self.max_num_seqs))
        buckets = tuple(sorted(set(self.request_buckets)))
        if buckets[0] < 1 or buckets[-1] != self.max_num_seqs:
            raise ValueError(f"request_buckets={self.request_buckets} must be >= 1 and end at "
                             f"max_num_seqs={self.max_num_seqs}")
        object.__setattr__(self, "request_buckets", buckets)
        if self.num_pages is not None and self.num_pages < 2:
            raise ValueError(f"num_pages={self.num_pages} must be >= 2 (page 0 is the reserved null page)")

    @property
    def pages_per_seq(self) -> int:
        """Block-table width: a verify may write k_max positions past the last committed token."""
        return -(-(self.max_model_len + self.max_num_speculative_tokens) // self.page_size)

    @property
    def total_pages(self) -> int:
        """Pages in each layer's pool, including the reserved null page 0."""
        return self.num_pages if self.num_pages is not None else 1 + self.max_num_seqs * self.pages_per_seq

    @property
    def state_slots_per_seq(self) -> int:
        return 1 + self.max_num_speculative_tokens

    def request_bucket(self, num_reqs: int) -> int:
        for b in self.request_buckets:
            if b >= num_reqs:
                return b
        raise ValueError(f"num_reqs={num_reqs} exceeds max_num_seqs={self.max_num_seqs}")


def prefill_row_buckets(prefill_rows: int) -> tuple[int, ...]:
    """Row counts of the prefill executables for Model.prefill_rows: the powers of two below it and
    prefill_rows itself. A call with n requests' chunks runs the smallest bucket >= n, so a lone
    request never computes prefill_rows - 1 padding rows."""
    buckets, b = [], 1
    while b < prefill_rows:
        buckets.append(b)
        b *= 2
    return (*buckets, prefill_rows)
