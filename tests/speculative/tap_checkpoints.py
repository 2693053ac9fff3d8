"""Random EAGLE-3 and DFlash drafter checkpoints in their published layouts (config.json +
model.safetensors under the HF tensor names that vLLM / SGLang / the reference code read), written
here from the layouts themselves, not by jaxspec, so the loaders are tested against the format.

EAGLE-3 (SafeAILab EAGLE-3, LlamaForCausalLMEagle3): fc.weight [H, 3H]; midlayer.{input_layernorm,
hidden_norm, post_attention_layernorm}.weight [H]; midlayer.self_attn.{q,k,v}_proj.weight [heads*D, 2H]
(the input is cat[embedding, hidden]); o_proj [H, nH*D]; midlayer.mlp.{gate,up,down}_proj; norm.weight;
lm_head.weight [draft_vocab, H]; d2t [draft_vocab] int64 offsets (target id = draft id + d2t);
t2d [vocab] bool. DFlash (z-lab): fc.weight [H, n*H], hidden_norm.weight, layers.{l}.* Qwen3 decoder
layers (q_norm / k_norm), norm.weight; dflash_config {target_layer_ids, mask_token_id, block_size}.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from jaxspec.weights import write_safetensors


def _linear(rng, out: int, inp: int) -> np.ndarray:
    return (rng.standard_normal((out, inp)) / np.sqrt(inp)).astype(np.float32)


def _norm(rng, n: int) -> np.ndarray:
    return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)


def _layer(rng, p: str, H: int, q_in: int, nH: int, nKV: int, D: int, inner: int, qk_norm: bool) -> dict:
    t = {p + "input_layernorm.weight": _norm(rng, H), p + "post_attention_layernorm.weight": _norm(rng, H),
         p + "self_attn.q_proj.weight": _linear(rng, nH * D, q_in),
         p + "self_attn.k_proj.weight": _linear(rng, nKV * D, q_in),
         p + "self_attn.v_proj.weight": _linear(rng, nKV * D, q_in),
         p + "self_attn.o_proj.weight": _linear(rng, H, nH * D),
         p + "mlp.gate_proj.weight": _linear(rng, inner, H), p + "mlp.up_proj.weight": _linear(rng, inner, H),
         p + "mlp.down_proj.weight": _linear(rng, H, inner)}
    if qk_norm:
        t[p + "self_attn.q_norm.weight"] = _norm(rng, D)
        t[p + "self_attn.k_norm.weight"] = _norm(rng, D)
    return t


def _common(H: int, V: int, nH: int, nKV: int, D: int, inner: int, layers: int) -> dict:
    return {"hidden_size": H, "vocab_size": V, "num_attention_heads": nH, "num_key_value_heads": nKV,
            "head_dim": D, "intermediate_size": inner, "num_hidden_layers": layers, "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0, "hidden_act": "silu", "torch_dtype": "float32", "max_position_embeddings": 512}


def write_eagle3(directory, *, hidden: int, vocab: int, draft_vocab: int, layer_ids=(0, 1, 2),
                 ids_key: str | None = "eagle_config", norm_before_residual: bool = False, own_embed: bool = False,
                 seed: int = 0, heads: int = 4, kv_heads: int = 2, head_dim: int = 16, inner: int = 64,
                 overrides: dict | None = None) -> Path:
    """ids_key "eagle_config": eagle_config.eagle_aux_hidden_state_layer_ids = layer_ids (outputs of
    those layers, SGLang's reading); "top": top-level eagle_aux_hidden_state_layer_ids = layer_ids + 1
    (the inputs of the next layers, vLLM's reading: the same taps); None: no ids (the default taps)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    H = hidden
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
              **_common(H, vocab, heads, kv_heads, head_dim, inner, 1), "draft_vocab_size": draft_vocab}
    if norm_before_residual:
        config["norm_before_residual"] = True
    if ids_key == "eagle_config":
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(layer_ids), "use_aux_hidden_state": True}
    elif ids_key == "top":
        config["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in layer_ids]
    config.update(overrides or {})
    tensors = {"fc.weight": _linear(rng, H, 3 * H), "norm.weight": _norm(rng, H),
               "lm_head.weight": _linear(rng, draft_vocab, H), "midlayer.hidden_norm.weight": _norm(rng, H),
               **_layer(rng, "midlayer.", H, 2 * H, heads, kv_heads, head_dim, inner, qk_norm=False)}
    kept = np.sort(rng.choice(vocab, draft_vocab, replace=False))  # the draft vocabulary, in target ids
    tensors["d2t"] = (kept - np.arange(draft_vocab)).astype(np.int64)
    t2d = np.zeros(vocab, bool)
    t2d[kept] = True
    tensors["t2d"] = t2d
    if own_embed:
        tensors["embed_tokens.weight"] = rng.standard_normal((vocab, H)).astype(np.float32)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    write_safetensors(tensors, directory / "model.safetensors")
    return directory


def write_dflash(directory, *, hidden: int, vocab: int, target_layer_ids=(0, 2), mask_token_id: int = 0,
                 block_size: int = 8, num_layers: int = 2, seed: int = 0, heads: int = 4, kv_heads: int = 2,
                 head_dim: int = 16, inner: int = 64, dflash_overrides: dict | None = None) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    H = hidden
    config = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3",
              **_common(H, vocab, heads, kv_heads, head_dim, inner, num_layers),
              "layer_types": ["full_attention"] * num_layers, "is_causal": False, "tie_word_embeddings": False,
              "dflash_config": {"target_layer_ids": list(target_layer_ids), "mask_token_id": mask_token_id,
                                "block_size": block_size, **(dflash_overrides or {})}}
    tensors = {"fc.weight": _linear(rng, H, len(target_layer_ids) * H), "hidden_norm.weight": _norm(rng, H),
               "norm.weight": _norm(rng, H)}
    for i in range(num_layers):
        tensors.update(_layer(rng, f"layers.{i}.", H, H, heads, kv_heads, head_dim, inner, qk_norm=True))
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    write_safetensors(tensors, directory / "model.safetensors")
    return directory
