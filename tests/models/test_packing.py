"""Packed input projections (jaxspec/models/packing.py: GDN qkv | z | b | a, attention q | k | v, MLP
gate | up): who
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


def attention_layers(model):
    return [layer["attn"] for layer in model.params["layers"] if "attn" in layer]


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


def first_layer_pair(models, family, params_of, seed: int):
    """(config, a random input x [2, 5, H], the first such layer's canonical and packed params)."""
    xla, pallas = models[family, "xla"], models[family, "pallas"]
    x = jax.random.normal(jax.random.PRNGKey(seed), (2, 5, xla.config.hidden_size), jnp.float32)
    return xla.config, x, params_of(xla)[0], params_of(pallas)[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_project_and_train_read_either_layout(family, models):
    cfg, x, canonical, packed = first_layer_pair(models, family, gdn_layers, 0)
    for got, want in zip(packing.project(packed, cfg, x), packing.project(canonical, cfg, x), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(train.gated_delta_net(packed, cfg, x)),
                               np.asarray(train.gated_delta_net(canonical, cfg, x)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", MLP_FAMILIES)
def test_pallas_on_one_device_packs_every_attention_layer(family, models):
    xla, pallas = models[family, "xla"], models[family, "pallas"]
    cfg = pallas.config
    canonical, packed = attention_layers(xla), attention_layers(pallas)
    assert canonical and not any(packing.is_packed_attention(a) for a in canonical)
    q_out = cfg.num_attention_heads * cfg.head_dim * (2 if cfg.attn_output_gate else 1)
    assert packing.attention_widths(cfg) == (q_out,) + (cfg.num_key_value_heads * cfg.head_dim,) * 2
    for c, p in zip(canonical, packed, strict=True):
        assert packing.is_packed_attention(p) and not set(packing.ATTN_PARTS) & set(p)
        assert p[packing.ATTN_PACKED].shape == (cfg.hidden_size, sum(packing.attention_widths(cfg)))
        assert packing.ATTN_BIAS not in p  # the demo checkpoints have no q / k / v biases
        assert_trees_equal(packing.unpack_attention(p, cfg), c)
        assert packing.pack_attention(p) is p and packing.unpack_attention(c, cfg) is c


@pytest.mark.parametrize("family", MLP_FAMILIES)
def test_packed_attention_projects_and_trains_as_the_canonical_one(family, models):
    """project_attention and the whole-sequence attention (train) read either layout."""
    cfg, x, canonical, packed = first_layer_pair(models, family, attention_layers, 2)
    for got, want, name in zip(packing.project_attention(packed, cfg, x), packing.project_attention(canonical, cfg, x),
                               packing.ATTN_PARTS, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(want), np.asarray(x @ canonical[name]), rtol=1e-6, atol=1e-6)
    positions = jnp.broadcast_to(jnp.arange(5, dtype=jnp.int32), (2, 5))
    np.testing.assert_allclose(np.asarray(train.causal_attention(packed, cfg, x, positions)),
                               np.asarray(train.causal_attention(canonical, cfg, x, positions)), rtol=1e-5, atol=1e-5)


def test_attention_biases_pack_beside_their_weights():
    """A checkpoint with q / k / v biases (attention_bias): qkv_bias holds them in the weights' column
    order (zeros for a missing one), the packed projection adds them, and unpacking gives them back."""
    cfg = jaxspec.load("demo:qwen3", **dict(SETTINGS, dtype="float32")).config
    widths = packing.attention_widths(cfg)
    keys = jax.random.split(jax.random.PRNGKey(3), 6)
    attn = {name: jax.random.normal(key, (cfg.hidden_size, width)) for name, key, width
            in zip(packing.ATTN_PARTS, keys[:3], widths, strict=True)}
    attn.update({name + "_bias": jax.random.normal(key, (width,)) for name, key, width
                 in zip(packing.ATTN_PARTS, keys[3:], widths, strict=True)})
    attn["o"] = jnp.ones((widths[0], cfg.hidden_size))
    packed = packing.pack_attention(attn)
    assert sorted(packed) == ["o", packing.ATTN_PACKED, packing.ATTN_BIAS]
    np.testing.assert_array_equal(np.asarray(packed[packing.ATTN_BIAS][widths[0]:widths[0] + widths[1]]),
                                  np.asarray(attn["k_bias"]))
    x = jax.random.normal(jax.random.PRNGKey(4), (3, cfg.hidden_size))
    for got, name in zip(packing.project_attention(packed, cfg, x), packing.ATTN_PARTS, strict=True):
        want = x @ attn[name] + attn[name + "_bias"]
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert_trees_equal(packing.unpack_attention(packed, cfg), attn)
    no_k_bias = {key: value for key, value in attn.items() if key != "k_bias"}
    np.testing.assert_array_equal(np.asarray(packing.pack_attention(no_k_bias)[packing.ATTN_BIAS][widths[0]:][
        :widths[1]]), np.zeros(widths[1]))


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
