"""HF parity with kernels="pallas" for head sizes that are not powers of two: attention head_dim 24 /
48 and GDN key / value head dims 24 / 48, which the Pallas wrappers zero-pad to kernel sizes
(interpret mode on CPU). The same gates as tests/models/test_hf_parity.py: prompt logits within
1e-4 relative RMS of HF, identical greedy generations."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import jaxspec
from tests.models.conftest import CHUNK, PAGE, hf_model, prompts

NEW_TOKENS = 8

# name -> (fixture kind, text-config overrides)
ODD_VARIANTS = {
    "qwen3-d24": ("qwen3", dict(head_dim=24)),
    "qwen3-d48": ("qwen3", dict(head_dim=48)),
    "qwen3_5-d24-gdn24x48": ("qwen3_5", dict(head_dim=24, linear_key_head_dim=24, linear_value_head_dim=48)),
    "qwen3_5-d48-gdn48x24": ("qwen3_5", dict(head_dim=48, linear_key_head_dim=48, linear_value_head_dim=24)),
}


def rel_rms(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b ** 2)))


@pytest.mark.parametrize("variant", sorted(ODD_VARIANTS))
def test_pallas_odd_head_dims_match_hf(variant, hf_checkpoint):
    kind, overrides = ODD_VARIANTS[variant]
    path = hf_checkpoint(kind, **overrides)
    model = jaxspec.load(path, dtype="float32", kernels="pallas", max_model_len=64, max_num_seqs=8,
                         prefill_chunk=CHUNK, page_size=PAGE)
    hf = hf_model(path)
    ps = prompts(model.config.vocab_size)
    with torch.no_grad():
        hf_logits = hf(torch.tensor([ps[-1]])).logits[0].numpy()
        hf_gens = [hf.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(p):].tolist()
                   for p in ps]
    assert rel_rms(jaxspec.score(model, ps[-1]), hf_logits) < 1e-4
    assert jaxspec.generate(model, ps, max_new_tokens=NEW_TOKENS).token_ids == hf_gens
