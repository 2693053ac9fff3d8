"""Packed input projections (jaxspec/models/packing.py: GDN qkv | z | b | a, MLP gate | up): who
packs, that every path reads the packed layout as it reads the canonical one, and that nothing
written out is packed."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec import weights
from jaxspec.models import layers, packing, train
from tests.demo_models import SETTINGS, prompts
from tests.models.test_hf_parity import rel_rms

FAMILIES = ("qwen3_5", "qwen3_next")  # GDN layers
MLP_FAMILIES = ("qwen3", "qwen3_5", "qwen3_next")  # dense MLPs (qwen3, qwen3_5) or MoE shared experts (qwen3_next)


@pytest.fixture(scope="module")
def models():
    """{(family, kernels): Model}: the same seeded demo weights, loaded for the XLA and Pallas paths."""
    settings = dict(SETTINGS, dtype="float32")
    return {(family, kernels): jaxspec.load(f"demo:{family}", **dict(settings, kernels=kernels))
            for family in MLP_FAMILIES for kernels in ("xla", "pallas")}


def mlps(model):
    """Every SwiGLU MLP's params: dense layers' and MoE shared experts'."""
    out = [layer["mlp"] for layer in model.params["layers"] if "mlp" in layer]
    return out + [layer["moe"]["shared"] for layer in model.params["layers"] if "shared" in layer.get("moe", {})]


def gdn_layers(model):
    return [layer["gdn"] for layer in model.params["layers"] if "gdn" in layer]


def assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("family", FAMILIES)
def test_pallas_on_one_device_packs_every_gdn_layer(family, models):
    xla, pallas = models[family, "xla"], models[family, "pallas"]
    cfg = pallas.config
    assert not any(packing.is_packed(g) for g in gdn_layers(xla))
    packed = gdn_layers(pallas)
    assert packed and all(packing.is_packed(g) and not set(packing.PARTS) & set(g) for g in packed)
    hv = cfg.linear_num_value_heads
    assert packed[0][packing.PACKED].shape == (cfg.hidden_size, cfg.gdn_conv_dim + cfg.gdn_value_dim + 2 * hv)
    assert packing.offsets(cfg) == {"qkv": 0, "z": cfg.gdn_conv_dim, "b": cfg.gdn_conv_dim + cfg.gdn_value_dim,
                                    "a": cfg.gdn_conv_dim + cfg.gdn_value_dim + hv}
    assert packing.packs(cfg, "pallas") and not packing.packs(cfg, "xla")
    assert not packing.packs(cfg.replace(mesh=object()), "pallas")  # sharded params are never packed


@pytest.mark.parametrize("family", MLP_FAMILIES)
def test_pallas_on_one_device_packs_every_mlp(family, models):
    xla, pallas = models[family, "xla"], models[family, "pallas"]
    assert mlps(xla) and not any(packing.is_packed_mlp(m) for m in mlps(xla))
    for canonical, packed in zip(mlps(xla), mlps(pallas), strict=True):
        assert packing.is_packed_mlp(packed) and not set(packing.MLP_PARTS) & set(packed)
        H, inter = canonical["gate"].shape
        assert packed[packing.MLP_PACKED].shape == (H, 2 * inter)
        np.testing.assert_array_equal(np.asarray(packed["down"]), np.asarray(canonical["down"]))
    assert all(packing.is_packed_layer(layer) for layer in pallas.params["layers"])
    assert not any(packing.is_packed_layer(layer) for layer in xla.params["layers"])


@pytest.mark.parametrize("family", MLP_FAMILIES)
def test_packed_mlp_gives_the_canonical_output(family, models):
    """One gemm over gate_up and a split: the two dots' values (float32 summation order only)."""
    xla, pallas = models[family, "xla"], models[family, "pallas"]
    canonical, packed = mlps(xla)[0], mlps(pallas)[0]
    x = jax.random.normal(jax.random.PRNGKey(1), (7, canonical["gate"].shape[0]), jnp.float32)
    np.testing.assert_allclose(np.asarray(layers.mlp(packed, x)), np.asarray(layers.mlp(canonical, x)),
                               rtol=1e-5, atol=1e-6)
    assert_trees_equal(packing.unpack_mlp(packed), canonical)
    assert packing.pack_mlp(packed) is packed and packing.unpack_mlp(canonical) is canonical


@pytest.mark.parametrize("family", MLP_FAMILIES)
def test_unpack_gives_back_the_canonical_params(family, models):
    xla, pallas = models[family, "xla"], models[family, "pallas"]
    assert_trees_equal(packing.unpack(pallas.params, pallas.config), xla.params)
    again = dataclasses.replace(pallas, _engines={})  # packing a packed tree changes nothing
    assert all(a[packing.PACKED] is b[packing.PACKED] for a, b in zip(gdn_layers(again), gdn_layers(pallas),
                                                                      strict=True))
    assert all(a[packing.MLP_PACKED] is b[packing.MLP_PACKED] for a, b in zip(mlps(again), mlps(pallas), strict=True))


@pytest.mark.parametrize("family", MLP_FAMILIES)
def test_packed_params_run_the_xla_path_as_the_canonical_ones(family, models):
    """The layer reads packed params under either kernels; the XLA path gives the canonical model's logits."""
    xla, pallas = models[family, "xla"], models[family, "pallas"]
    packed_xla = dataclasses.replace(pallas, kernels="xla", _engines={})
    for tokens in prompts(1, lengths=(1, 17)):  # one gemm vs four: float32 summation order only
        got, want = jaxspec.score(packed_xla, tokens), jaxspec.score(xla, tokens)
        assert rel_rms(got, want) < 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_project_and_train_read_either_layout(family, models):
    xla, pallas = models[family, "xla"], models[family, "pallas"]
    cfg = xla.config
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 5, cfg.hidden_size), jnp.float32)
    canonical, packed = gdn_layers(xla)[0], gdn_layers(pallas)[0]
    for got, want in zip(packing.project(packed, cfg, x), packing.project(canonical, cfg, x), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(train.gated_delta_net(packed, cfg, x)),
                               np.asarray(train.gated_delta_net(canonical, cfg, x)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])  # dense MLPs; MoE shared experts
def test_save_and_export_write_the_canonical_layout(family, models, tmp_path):
    xla, pallas = models[family, "xla"], models[family, "pallas"]
    saved = jaxspec.save(pallas, tmp_path / "saved")
    reloaded = jaxspec.load(saved, **dict(SETTINGS, dtype="float32"))  # kernels="xla": the canonical layout
    assert_trees_equal(reloaded.params, xla.params)
    names = " ".join(weights.read_checkpoint_tensors(saved / "params.safetensors"))
    assert "in_proj" not in names and "gate_up" not in names
    got, want = weights.params_to_hf(pallas.config, pallas.params), weights.params_to_hf(xla.config, xla.params)
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]), err_msg=name)
