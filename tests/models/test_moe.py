"""The sparse MoE block (models/layers.moe): the gathered path (N * top_k < E, decode and short spans)
and the dense path both equal a per-token float64 loop over the chosen experts."""

from __future__ import annotations

import numpy as np
import pytest

from jaxspec import demo
from jaxspec.config import ModelConfig
from jaxspec.models import layers

E, K, H, INTER = 16, 2, 32, 24  # gathered for N < 8, dense from N = 8


def config(norm_topk: bool) -> ModelConfig:
    hf = dict(demo.DEMO_HF_CONFIGS["qwen3_moe"], num_experts=E, num_experts_per_tok=K, hidden_size=H,
              moe_intermediate_size=INTER, norm_topk_prob=norm_topk)
    return ModelConfig.from_hf(hf)


def reference(p, x, norm_topk: bool) -> np.ndarray:
    p = {k: np.asarray(v, np.float64) for k, v in p.items()}
    out = []
    for row in np.asarray(x, np.float64):
        logits = row @ p["router"]
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        chosen = np.argsort(-probs, kind="stable")[:K]
        w = probs[chosen] / (probs[chosen].sum() if norm_topk else 1.0)
        acc = np.zeros(H)
        for e, we in zip(chosen, w, strict=True):
            g, u = row @ p["gate"][e], row @ p["up"][e]
            acc += we * ((g / (1 + np.exp(-g)) * u) @ p["down"][e])
        out.append(acc)
    return np.stack(out)


@pytest.mark.parametrize("n", [1, 3, 7, 8, 12])
@pytest.mark.parametrize("norm_topk", [True, False])
def test_moe_equals_a_per_token_loop(n, norm_topk):
    rng = np.random.default_rng(n)
    p = {"router": rng.standard_normal((H, E)), "gate": rng.standard_normal((E, H, INTER)) / H**0.5,
         "up": rng.standard_normal((E, H, INTER)) / H**0.5, "down": rng.standard_normal((E, INTER, H)) / INTER**0.5}
    p = {k: np.asarray(v, np.float32) for k, v in p.items()}
    x = rng.standard_normal((n, H)).astype(np.float32)
    got = np.asarray(layers.moe(p, config(norm_topk), x), np.float64)
    want = reference(p, x, norm_topk)
    assert np.sqrt(np.mean((got - want) ** 2) / np.mean(want**2)) < 1e-5
