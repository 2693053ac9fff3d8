"""Tiny random Hugging Face checkpoints for the test suite, written with save_pretrained.

Sizes are chosen so that no two dimensions coincide by accident: hidden 48, head_dim 16 (not
48/4), GDN dk 8 != dv 12, moe_intermediate 20 (2*20 != 48). Hybrid kinds have 4 layers with
full_attention_interval 2 (pattern L F L F). EOS ids: config.json V-1, generation_config.json
[V-1, V-2].

Weights are re-initialised (seeded) so the model is not degenerate: linear / embedding weights
~ N(0, 1/fan_in), norms perturbed around their identity, A_log = log U(1, 16), dt_bias ~ N(0, 0.5).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

KINDS = ("qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_wrapped", "qwen3_5_moe", "qwen3_next")
VOCAB = 160

_COMMON = {"vocab_size": VOCAB, "hidden_size": 48, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "rms_norm_eps": 1e-6, "max_position_embeddings": 512, "tie_word_embeddings": False}
_HYBRID = {"num_hidden_layers": 4, "full_attention_interval": 2, "linear_num_key_heads": 2,
           "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 12,
           "linear_conv_kernel_dim": 4,
           "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}}
_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 20}

# kind -> text-config kwargs (before overrides)
_TEXT = {
    "qwen3": dict(_COMMON, num_hidden_layers=2, intermediate_size=64),
    "qwen3_moe": dict(_COMMON, **_MOE, num_hidden_layers=3, intermediate_size=64, mlp_only_layers=[1],
                      norm_topk_prob=True),
    "qwen3_5": dict(_COMMON, **_HYBRID, intermediate_size=64),
    "qwen3_5_wrapped": dict(_COMMON, **_HYBRID, intermediate_size=64),
    "qwen3_5_moe": dict(_COMMON, **_HYBRID, **_MOE, shared_expert_intermediate_size=24),
    "qwen3_next": dict(_COMMON, **_HYBRID, **_MOE, intermediate_size=64, shared_expert_intermediate_size=24),
}
_VISION = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 48,
           "patch_size": 4, "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 64}


def _hybrid_layer_types(text: dict[str, Any]) -> None:
    """full_attention_interval -> explicit layer_types (HF configs take the list)."""
    interval = text.pop("full_attention_interval", None)
    if "linear_num_key_heads" in text and "layer_types" not in text:
        n = text["num_hidden_layers"]
        text["layer_types"] = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]


def build_model(kind: str, **overrides) -> torch.nn.Module:
    """The HF model (float32, random weights seeded by torch.manual_seed) for `kind`."""
    import transformers as tf

    if kind not in _TEXT:
        raise ValueError(f"kind={kind!r} is not a fixture kind; valid: {', '.join(KINDS)}")
    text = dict(_TEXT[kind], **overrides)
    text.setdefault("eos_token_id", text["vocab_size"] - 1)
    text.setdefault("bos_token_id", text["vocab_size"] - 3)
    _hybrid_layer_types(text)
    if kind == "qwen3":
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**text))
    elif kind == "qwen3_moe":
        model = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**text))
    elif kind == "qwen3_5":
        model = tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**text))
    elif kind == "qwen3_5_wrapped":
        # Released Qwen3.5 configs carry the flag at both levels; transformers ties by the outer one.
        cfg = tf.Qwen3_5Config(text_config=text, vision_config=_VISION, tie_word_embeddings=text["tie_word_embeddings"])
        model = tf.Qwen3_5ForConditionalGeneration(cfg)
    elif kind == "qwen3_5_moe":
        model = tf.Qwen3_5MoeForCausalLM(tf.Qwen3_5MoeTextConfig(**text))
    else:
        model = tf.Qwen3NextForCausalLM(tf.Qwen3NextConfig(**text))
    return model.float().eval()


def _zero_centred(kind: str) -> bool:
    return kind not in ("qwen3", "qwen3_moe")


@torch.no_grad()
def randomize(model: torch.nn.Module, kind: str, seed: int) -> None:
    """Non-degenerate seeded weights (see the module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        if name.endswith("A_log"):
            p.copy_(torch.log(1 + 15 * torch.rand(p.shape, generator=gen)))
        elif name.endswith("dt_bias"):
            p.copy_(0.5 * noise)
        elif p.ndim == 1 and "norm" in name:
            gdn_norm = "linear_attn.norm" in name  # RMSNormGated: plain w * x, identity at 1
            identity = 0.0 if _zero_centred(kind) and not gdn_norm and "visual" not in name else 1.0
            p.copy_(identity + 0.1 * noise)
        elif p.ndim == 1:
            p.copy_(0.1 * noise)
        else:
            p.copy_(noise / math.sqrt(p.shape[-1]))  # tied lm_head is the same Parameter as embed


def _write_generation_config(directory: Path, vocab: int) -> None:
    gen = {"eos_token_id": [vocab - 1, vocab - 2], "bos_token_id": vocab - 3, "do_sample": False}
    (directory / "generation_config.json").write_text(json.dumps(gen, indent=2))


def make_hf_checkpoint(kind: str, directory, *, seed: int = 0, max_shard_size: str | int | None = None,
                       mtp: bool = False, **overrides) -> Path:
    """Writes a tiny random HF checkpoint of `kind` (one of KINDS) to `directory` with
    save_pretrained; `overrides` replace text-config fields (e.g. num_key_value_heads=1,
    linear_num_value_heads=6, tie_word_embeddings=True). max_shard_size shards the weights;
    mtp=True adds mtp.* weights (see add_mtp_weights). Returns the directory."""
    directory = Path(directory)
    torch.manual_seed(seed)
    model = build_model(kind, **overrides)
    randomize(model, kind, seed)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(directory, **kwargs)
    _write_generation_config(directory, overrides.get("vocab_size", VOCAB))
    if mtp:
        add_mtp_weights(directory, seed=seed + 1)
    return directory


# ---- mtp.* weights (HF ignores them; vLLM's layout) ---------------------------------------------

def _read_all(directory: Path) -> tuple[dict[str, np.ndarray], dict | None]:
    from jaxspec.weights import read_checkpoint_tensors

    index = directory / "model.safetensors.index.json"
    tensors = {k: np.array(v) for k, v in read_checkpoint_tensors(directory).items()}
    return tensors, (json.loads(index.read_text()) if index.exists() else None)


def _first_attention_prefix(config: dict[str, Any]) -> str:
    text = config.get("text_config", config)
    layer = text["layer_types"].index("full_attention")
    return f"model.language_model.layers.{layer}." if "text_config" in config else f"model.layers.{layer}."


def mtp_tensors(directory, seed: int = 1) -> dict[str, np.ndarray]:
    """Random mtp.* tensors for the checkpoint at `directory`: fc [H, 2H], three norms and one
    full-attention decoder layer shaped like the trunk's first attention layer."""
    directory = Path(directory)
    config = json.loads((directory / "config.json").read_text())
    tensors, _ = _read_all(directory)
    prefix = _first_attention_prefix(config)
    rng = np.random.default_rng(seed)
    out = {}
    for name, t in tensors.items():
        if name.startswith(prefix):
            scale = 0.1 if t.ndim == 1 else 1 / math.sqrt(t.shape[-1])
            out["mtp.layers.0." + name[len(prefix):]] = (scale * rng.standard_normal(t.shape)).astype(t.dtype)
    hidden = (config.get("text_config") or config)["hidden_size"]
    out["mtp.fc.weight"] = (rng.standard_normal((hidden, 2 * hidden)) / math.sqrt(2 * hidden)).astype(np.float32)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        out[f"mtp.{norm}.weight"] = (0.1 * rng.standard_normal(hidden)).astype(np.float32)
    return out


def add_mtp_weights(directory, seed: int = 1) -> dict[str, np.ndarray]:
    """Adds mtp_tensors(directory) to the saved checkpoint (a new shard when sharded, else a
    rewritten model.safetensors) and sets mtp_num_hidden_layers=1 in config.json."""
    from jaxspec.weights import write_safetensors

    directory = Path(directory)
    extra = mtp_tensors(directory, seed)
    tensors, index = _read_all(directory)
    if index is None:
        write_safetensors({**tensors, **extra}, directory / "model.safetensors")
    else:
        write_safetensors(extra, directory / "model-mtp.safetensors")
        index["weight_map"].update({k: "model-mtp.safetensors" for k in extra})
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    (config.get("text_config") or config)["mtp_num_hidden_layers"] = 1
    config_path.write_text(json.dumps(config, indent=2))
    return extra
