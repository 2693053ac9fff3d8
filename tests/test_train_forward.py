"""The training forward (jaxspec/models/train.py) computes what the engine computes: its logits equal
`jaxspec.score` of the same params (float32, CPU), over a sequence that crosses the engine's prefill
chunks and the GDN chunk (64); and the MTP head is causal (row t sees tokens <= t+1 only)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec.models import train

LENGTH = 150  # > 2 GDN chunks of 64, 5 engine prefill chunks of 32
forward = jax.jit(train.forward, static_argnums=1)
mtp_logits = jax.jit(train.mtp_logits, static_argnums=1)


def assert_forward_equals_score(model: jaxspec.Model, tokens: list[int]) -> None:
    want = jaxspec.score(model, tokens)  # [T, V] float32 through the paged engine
    got, _ = forward(model.params, model.config, jnp.asarray([tokens]))
    got = np.asarray(got[0])
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * scale)
    assert (got.argmax(-1) == want.argmax(-1)).all()


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_forward_equals_score_random_demo(family):
    model = jaxspec.load(f"demo:{family}", dtype="float32", kernels="xla", max_model_len=256, prefill_chunk=32)
    tokens = np.random.default_rng(0).integers(0, 256, size=LENGTH).tolist()
    assert_forward_equals_score(model, tokens)


def test_forward_equals_score_trained_demo():
    """The shipped trained target: tied embeddings, zero-centred norms, GVA GDN, partial RoPE."""
    model = jaxspec.load("demo", dtype="float32", kernels="xla", max_model_len=256, prefill_chunk=32)
    text = "import os\nimport sys\n\n\nclass Config:\n    def __init__(self, path):\n        self.path = path\n" * 8
    tokens = model.tokenizer.encode(text)[:LENGTH]
    assert len(tokens) > 64
    assert_forward_equals_score(model, tokens)


def test_mtp_head_is_causal():
    """MTP row t reads hidden_t and token t+1: changing tokens from t+2 on leaves rows <= t unchanged."""
    model = jaxspec.load("demo", dtype="float32", kernels="xla")
    assert "mtp" in model.params and model.config.mtp_num_hidden_layers == 1
    rng = np.random.default_rng(1)
    a = rng.integers(0, model.config.vocab_size - 3, size=(1, 40))
    b = a.copy()
    b[0, 22:] = rng.integers(0, model.config.vocab_size - 3, size=18)

    def rows(tokens):
        tokens = jnp.asarray(tokens)
        _, hidden = forward(model.params, model.config, tokens[:, :-1])
        return np.asarray(mtp_logits(model.params, model.config, hidden, tokens[:, 1:]))[0]  # row t -> t+2

    ra, rb = rows(a), rows(b)
    np.testing.assert_array_equal(ra[:21], rb[:21])  # rows 0..20 see tokens <= 21
    assert not np.allclose(ra[21:], rb[21:])


def test_chunk_gated_delta_matches_reference():
    """GVA (HV = 2 HK), dk != dv, T not a multiple of the chunk; against the float64 per-token loop."""
    from pallas_kernels.gated_delta import reference as ref

    rng = np.random.default_rng(3)
    B, T, HK, HV, dk, dv = 2, 150, 2, 4, 16, 12
    q = ref.l2norm(rng.standard_normal((B, T, HK, dk))) * dk ** -0.5
    k = ref.l2norm(rng.standard_normal((B, T, HK, dk)))
    v = rng.standard_normal((B, T, HV, dv)).astype(np.float32)
    g = -0.1 * np.abs(rng.standard_normal((B, T, HV))).astype(np.float32)
    beta = jax.nn.sigmoid(rng.standard_normal((B, T, HV)).astype(np.float32))
    want, _ = ref.naive_gated_delta(q, k, v, g, beta, np.zeros((B, HV, dk, dv)))
    got = np.asarray(train.chunk_gated_delta(q, k, v, g, beta))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
