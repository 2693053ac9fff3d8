"""Decoding token by token (prefill of the first token, then one verify step per token) gives the
logits of one forward over the whole sequence (float32, CPU).

Runs in a fresh process with XLA's default code generation (tests/conftest.py, FRESH_PROCESS_FILES):
under the suite's fast-compile flags XLA:CPU rounds the Qwen3-Next (MoE) decode steps apart from the
full forward by 2.1e-5 relative RMS, against 1.6e-6 with its defaults (jax 0.10.2; the decode steps
then also drift from HF's float32 logits by up to 6.5e-5 at single positions, the full forward by
5.5e-6), so the 1e-5 gate below holds what users run.
"""

from __future__ import annotations

import pytest

import jaxspec
from tests.models.conftest import prompts
from tests.models.test_hf_parity import rel_rms


@pytest.mark.parametrize("variant", ["qwen3-gqa2", "qwen3_5-gva2-tied", "qwen3_5_moe", "qwen3_next-gva2"])
def test_incremental_decode_equals_full_forward(variant, jax_model):
    model, _ = jax_model(variant)
    tokens = prompts(model.config.vocab_size, seed=1)[-1] + list(range(5))
    full = jaxspec.score(model, tokens)
    incremental = jaxspec.score(model, tokens, incremental=True)
    assert rel_rms(incremental, full) < 1e-5
