"""HF transformers is the numerical oracle: logits and greedy generations of tiny random checkpoints
of every family must match (float32, CPU)."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxspec
from jaxspec.cache import cache_shapes
from jaxspec.models import layers
from jaxspec.models.model import StepBatch, forward
from jaxspec.ops import resolve_kernels
from pallas_kernels.linear import api as linear_api
from pallas_kernels.linear.kernel import gated_fits
from tests.jaxprs import pallas_calls
from tests.models.conftest import CHUNK, VARIANTS, hf_model, prompts

NEW_TOKENS = 24


def rel_rms(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b ** 2)))


@pytest.fixture(scope="module")
def hf_reference(jax_model):
    """Per variant: HF logits of the longest prompt and HF greedy continuations of every prompt."""
    cache = {}

    def get(variant):
        if variant not in cache:
            model, path = jax_model(variant)
            hf = hf_model(path)
            ps = prompts(model.config.vocab_size)
            with torch.no_grad():
                logits = hf(torch.tensor([ps[-1]])).logits[0].numpy()
                gens = []
                for p in ps:
                    out = hf.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False)
                    gens.append(out[0, len(p):].tolist())
            cache[variant] = (logits, gens)
        return cache[variant]

    return get


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_prompt_logits_match_hf(variant, jax_model, hf_reference):
    model, _ = jax_model(variant)
    hf_logits, _ = hf_reference(variant)
    ours = jaxspec.score(model, prompts(model.config.vocab_size)[-1])
    assert rel_rms(ours, hf_logits) < 1e-4


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_generation_matches_hf(variant, jax_model, hf_reference):
    """All prompt lengths (crossing chunk and page boundaries) batched together in one call."""
    model, _ = jax_model(variant)
    _, hf_gens = hf_reference(variant)
    result = jaxspec.generate(model, prompts(model.config.vocab_size), max_new_tokens=NEW_TOKENS)
    assert result.token_ids == hf_gens
    assert max(len(g) for g in hf_gens) == NEW_TOKENS  # at least one run reached the full length


PALLAS_VARIANTS = ["qwen3-gqa2", "qwen3-bias", "qwen3_5-gva2-d16", "qwen3_next-gva3-d16", "qwen3_5_moe"]


@pytest.mark.parametrize("variant", PALLAS_VARIANTS)
def test_pallas_kernels_match_hf(variant, jax_model, hf_reference):
    """The same parity gates with the Pallas kernels (interpret mode on CPU)."""
    model, _ = jax_model(variant, kernels="pallas")
    hf_logits, hf_gens = hf_reference(variant)
    ps = prompts(model.config.vocab_size)
    assert rel_rms(jaxspec.score(model, ps[-1]), hf_logits) < 1e-4
    assert jaxspec.generate(model, ps, max_new_tokens=NEW_TOKENS).token_ids == hf_gens


def model_step_pallas_calls(model, kernels: str, mode: str, T: int, kernel: str | None = None) -> int:
    """pallas_call equations (of `kernel`, if given) in the jaxpr of one step of model.forward over 2 rows
    of T tokens."""
    ecfg = model.engine_config(3)
    caches = cache_shapes(model.config, ecfg, model.dtype)
    i32 = jax.ShapeDtypeStruct((2,), jnp.int32)
    batch = StepBatch(tokens=jax.ShapeDtypeStruct((2, T), jnp.int32), start_pos=i32, num_valid=i32,
                      block_tables=jax.ShapeDtypeStruct((2, ecfg.pages_per_seq), jnp.int32), state_read=i32,
                      state_write=i32, conv_read=i32, conv_offset=i32, conv_write=i32)

    def step(params, caches, batch):
        return forward(params, model.config, caches, batch, mode=mode, kernels=kernels, last_only=False)

    return pallas_calls(step, model.params, caches, batch, kernel=kernel)


@pytest.mark.parametrize("variant", PALLAS_VARIANTS)
def test_pallas_kernels_are_in_the_model_step(variant, jax_model):
    """kernels="pallas" puts a pallas_call into the model's prefill and verify steps (attention,
    and for the hybrids GDN and conv, the MoE's grouped glu and down projection), kernels="xla" none:
    the parity test above runs the kernels."""
    model, _ = jax_model(variant, kernels="pallas")
    assert resolve_kernels(model.kernels) == "pallas"
    for mode, T in (("prefill", CHUNK), ("verify", 4)):
        calls = model_step_pallas_calls(model, "pallas", mode, T)
        # attention layers: paged attention; GDN layers: the recurrence and the conv; MoE: glu and down
        cfg = model.config
        want = len(cfg.attention_layers) + 2 * len(cfg.gdn_layers) + 2 * cfg.mlp_kinds.count("moe")
        assert calls >= want, (mode, calls)
        assert model_step_pallas_calls(model, "xla", mode, T) == 0


def fused_projections_per_step(cfg) -> int:
    """Fused projections of a decode / verify step: per GDN layer its input (norm + in_proj) and, where
    the kernel takes the value head dim as its gated norm's group, out projections; per attention layer
    two (norm + q / k / v, o + residual; an o projection with a bias runs as XLA's gemm); per dense MLP
    two (norm + gate / up + SwiGLU, down + residual)."""
    gdn = 1 + gated_fits(cfg.linear_value_head_dim)
    attention = 1 + (not cfg.attention_bias)
    return gdn * len(cfg.gdn_layers) + attention * len(cfg.attention_layers) + 2 * cfg.mlp_kinds.count("dense")


@contextlib.contextmanager
def fused_kernel(on: bool):
    """layers.FUSED_KERNEL set to `on` for the block; jit caches cleared on both sides, since the flag is
    read when a step is traced."""
    before = layers.FUSED_KERNEL
    layers.FUSED_KERNEL = on
    jax.clear_caches()
    try:
        yield
    finally:
        layers.FUSED_KERNEL = before
        jax.clear_caches()


@pytest.mark.parametrize("variant", PALLAS_VARIANTS)
def test_projections_are_fused_at_a_verify_steps_rows(variant, jax_model):
    """With the fused kernel on, at a verify step's rows (2 x 4) every sublayer's projection runs with
    its norm and residual or SwiGLU as one fused_linear kernel; past the kernel's rows (a prefill chunk
    of 2 x 33) XLA's gemm. Off (the default, docs/architecture.md "Fused projections"), none."""
    model, _ = jax_model(variant, kernels="pallas")
    assert model_step_pallas_calls(model, "pallas", "verify", 4, kernel="fused_linear") == 0
    with fused_kernel(True):
        verify = model_step_pallas_calls(model, "pallas", "verify", 4, kernel="fused_linear")
        assert verify == fused_projections_per_step(model.config), verify
        T = linear_api.MAX_ROWS // 2 + 1
        assert model_step_pallas_calls(model, "pallas", "prefill", T, kernel="fused_linear") == 0


@pytest.mark.parametrize("variant", ["qwen3-bias", "qwen3_5-gva2-d16"])
def test_fused_kernel_matches_hf(variant, jax_model, hf_reference):
    """The parity gates with the fused projection kernel on: norms, SwiGLU, residuals, the GDN's gated
    norm and gated attention's output gate inside the projections (interpret mode on CPU)."""
    model, _ = jax_model(variant, kernels="pallas")
    hf_logits, hf_gens = hf_reference(variant)
    ps = prompts(model.config.vocab_size)
    with fused_kernel(True):
        assert model_step_pallas_calls(model, "pallas", "verify", 4, kernel="fused_linear") > 0
        assert rel_rms(jaxspec.score(model, ps[-1]), hf_logits) < 1e-4
        assert jaxspec.generate(model, ps, max_new_tokens=NEW_TOKENS).token_ids == hf_gens
