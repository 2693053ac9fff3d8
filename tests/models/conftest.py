"""Tiny HF checkpoints loaded into jaxspec once per session (float32, small chunk and pages so that
prompts cross chunk and page boundaries)."""

from __future__ import annotations

import json

import pytest

import jaxspec

CHUNK, PAGE = 8, 4
PROMPT_LENGTHS = (1, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 3)

# (fixture kind, text-config overrides): GQA ratios 1/2/3, GVA ratios 1/2/3, tied and untied, MoE
# with and without a shared expert, the multimodal-wrapped Qwen3.5 layout, attention biases.
VARIANTS = {
    "qwen3-gqa1-tied": ("qwen3", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    "qwen3-gqa2": ("qwen3", dict()),
    "qwen3-gqa3": ("qwen3", dict(num_attention_heads=6, num_key_value_heads=2)),
    "qwen3-bias": ("qwen3", dict(attention_bias=True)),  # q / k / v / o biases
    "qwen3_moe": ("qwen3_moe", dict()),
    "qwen3_5-gva1": ("qwen3_5", dict(linear_num_value_heads=2)),
    "qwen3_5-gva2-tied": ("qwen3_5", dict(tie_word_embeddings=True)),
    "qwen3_5-gva3": ("qwen3_5", dict(linear_num_value_heads=6)),
    "qwen3_5_wrapped": ("qwen3_5_wrapped", dict()),
    "qwen3_5_moe": ("qwen3_5_moe", dict()),
    "qwen3_next-gva2": ("qwen3_next", dict()),
    "qwen3_next-gva3-tied": ("qwen3_next", dict(linear_num_value_heads=6, tie_word_embeddings=True)),
    # Triton dots need power-of-two head dims >= 16: the Pallas runs use dk = dv = 16.
    "qwen3_5-gva2-d16": ("qwen3_5", dict(linear_key_head_dim=16, linear_value_head_dim=16)),
    "qwen3_next-gva3-d16": ("qwen3_next", dict(linear_num_value_heads=6, linear_key_head_dim=16,
                                               linear_value_head_dim=16, tie_word_embeddings=True)),
}


@pytest.fixture(scope="session")
def jax_model(hf_checkpoint):
    """Factory: jax_model(variant) -> (jaxspec Model, checkpoint dir), cached per variant."""
    cache = {}

    def get(variant: str, kernels: str = "xla"):
        key = (variant, kernels)
        if key not in cache:
            kind, overrides = VARIANTS[variant]
            path = hf_checkpoint(kind, **overrides)
            model = jaxspec.load(path, dtype="float32", kernels=kernels, max_model_len=64, max_num_seqs=8,
                                 prefill_chunk=CHUNK, page_size=PAGE)
            cache[key] = (model, path)
        return cache[key]

    return get


def prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """Prompts of PROMPT_LENGTHS avoiding the EOS ids (the top of the vocabulary)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab - 3, size=n).tolist() for n in PROMPT_LENGTHS]


def hf_model(path):
    """The HF model saved at path, float32 eval mode."""
    import transformers

    cfg = json.loads((path / "config.json").read_text())
    cls = (transformers.Qwen3_5ForConditionalGeneration if cfg["model_type"] == "qwen3_5" and "text_config" in cfg
           else transformers.AutoModelForCausalLM)
    return cls.from_pretrained(path, torch_dtype="float32").eval()
