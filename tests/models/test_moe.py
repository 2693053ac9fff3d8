"""The sparse MoE block (models/layers.moe): the gathered path (N * top_k < E, decode and short spans)
and the grouped path (expert-sorted pairs through ragged_dot, or the Pallas grouped kernel with
kernels="pallas"), and the dense fallback, equal a per-token float64 loop over the chosen experts, in
float32 tightly and in bfloat16 by relative RMS, with tokens routed evenly or piled onto a few experts
(most experts get no rows)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import demo
from jaxspec.config import ModelConfig
from jaxspec.models import layers

E, K, H, INTER = 16, 2, 32, 24  # auto: gathered for N < 8, grouped from N = 8


def config(norm_topk: bool) -> ModelConfig:
    hf = dict(demo.DEMO_HF_CONFIGS["qwen3_moe"], num_experts=E, num_experts_per_tok=K, hidden_size=H,
              moe_intermediate_size=INTER, norm_topk_prob=norm_topk)
    return ModelConfig.from_hf(hf)


def reference(p, x, norm_topk: bool) -> tuple[np.ndarray, np.ndarray]:
    """(out [N, H], rows per expert [E]) by a float64 loop over tokens and their chosen experts."""
    p = {k: np.asarray(v, np.float64) for k, v in p.items()}
    out, counts = [], np.zeros(E, int)
    for row in np.asarray(x, np.float64):
        logits = row @ p["router"]
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        chosen = np.argsort(-probs, kind="stable")[:K]
        counts[chosen] += 1
        w = probs[chosen] / (probs[chosen].sum() if norm_topk else 1.0)
        acc = np.zeros(H)
        for e, we in zip(chosen, w, strict=True):
            g, u = row @ p["gate"][e], row @ p["up"][e]
            acc += we * ((g / (1 + np.exp(-g)) * u) @ p["down"][e])
        out.append(acc)
    return np.stack(out), counts


def inputs(n: int, seed: int, uneven: bool = False):
    """Random expert weights and x [n, H]. uneven: feature 0 is a large positive constant and the
    router's row 0 favours experts 0..2 and shuns 6..15, so most experts get no rows."""
    rng = np.random.default_rng(seed)
    p = {"router": rng.standard_normal((H, E)), "gate": rng.standard_normal((E, H, INTER)) / H**0.5,
         "up": rng.standard_normal((E, H, INTER)) / H**0.5, "down": rng.standard_normal((E, INTER, H)) / INTER**0.5}
    x = rng.standard_normal((n, H))
    if uneven:
        x[:, 0] = 3.0
        p["router"][0] = np.where(np.arange(E) < 3, 3.0, np.where(np.arange(E) >= 6, -3.0, 0.0))
    return {k: np.asarray(v, np.float32) for k, v in p.items()}, x.astype(np.float32)


def rel_rms(got, want) -> float:
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    return float(np.sqrt(np.mean((got - want) ** 2) / np.mean(want**2)))


@pytest.mark.parametrize("n", [1, 3, 7, 8, 12])
@pytest.mark.parametrize("norm_topk", [True, False])
def test_moe_equals_a_per_token_loop(n, norm_topk):
    p, x = inputs(n, seed=n)
    want, _ = reference(p, x, norm_topk)
    assert rel_rms(layers.moe(p, config(norm_topk), x), want) < 1e-5


def test_the_switch_point_is_n_top_k_against_the_experts():
    assert [layers.moe_path(n, E, K) for n in (1, 7, 8, 40)] == ["gather", "gather", "grouped", "grouped"]
    assert layers.moe_path(31, 256, 8) == "gather" and layers.moe_path(32, 256, 8) == "grouped"
    assert {layers.moe_path(n, 256, 8, "pallas") for n in (1, 31, 32, 512)} == {"grouped"}


ROUTINGS = [(1, False), (7, False), (8, True), (40, False), (40, True)]  # (N, uneven) across the switch at N = 8
CASES = ([(path, n, u) for path in ("gather", "grouped", "grouped-pallas") for n, u in ROUTINGS]
         + [("dense", n, True) for n in (8, 40)])


@pytest.mark.parametrize("path,n,uneven", CASES)
def test_every_path_equals_the_loop_in_float32_and_bfloat16(path, n, uneven):
    p, x = inputs(n, seed=100 + n, uneven=uneven)
    want, counts = reference(p, x, norm_topk=True)
    if uneven:  # the routing this case exists for: several empty experts, one crowded
        assert (counts == 0).sum() >= 8 and counts.max() >= n // 2, counts
    path, _, kernels = path.partition("-")
    f32, bf16 = both_dtypes(p, x, path, kernels or "xla")
    assert f32.dtype == jnp.float32 and rel_rms(f32, want) < 2e-6
    assert bf16.dtype == jnp.bfloat16 and rel_rms(bf16, want) < 2e-2


@functools.partial(jax.jit, static_argnames=("path", "kernels"))
def both_dtypes(p, x, path: str, kernels: str = "xla"):
    """moe in float32 and, on the same inputs rounded to bfloat16, in bfloat16 (one compile: the
    model runs it under jit too)."""
    low = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), (p, x))
    return (layers.moe(p, config(True), x, path=path, kernels=kernels),
            layers.moe(*low[:1], config(True), low[1], path=path, kernels=kernels))


def test_pallas_experts_under_a_mesh_run_per_device_and_sum():
    """kernels="pallas" on a 2-device mesh (experts split along I, as jaxspec/sharding.py lays
    them out): each device runs the grouped kernel on its columns, the down projection's partial
    sums are all-reduced (once, as on the XLA path), and the output equals the single-device one."""
    import dataclasses

    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxspec import sharding

    p, x = inputs(5, seed=21, uneven=True)
    cfg = dataclasses.replace(config(True), mesh=sharding.make_mesh(2))
    split = {"gate": P(None, None, sharding.AXIS), "up": P(None, None, sharding.AXIS),
             "down": P(None, sharding.AXIS, None), "router": P()}
    placed = {k: jax.device_put(v, NamedSharding(cfg.mesh, split[k])) for k, v in p.items()}
    run = jax.jit(lambda p, x: layers.moe(p, cfg, x, kernels="pallas"))
    got = run(placed, jax.device_put(x, NamedSharding(cfg.mesh, P())))
    assert sharding.count_collectives(run.lower(placed, x).compile().as_text()) == {"all-reduce": 1}
    np.testing.assert_allclose(np.asarray(got), np.asarray(layers.moe(p, config(True), x, kernels="pallas")),
                               rtol=1e-5, atol=1e-6)


def test_inert_columns_route_no_experts():
    """feed_forward with live_columns=1 on x [R, 2, H] (a plain decode step's inert second column):
    the live column equals the unmasked MoE, the inert one is zeros, and only R rows are routed
    (the router's top_k in the jaxpr sees R rows, not 2R)."""
    p, x = inputs(6, seed=11)
    x = jnp.asarray(x.reshape(3, 2, H))
    layer = {"moe": {k: jnp.asarray(v) for k, v in p.items()}}
    cfg = config(True)
    full = layers.feed_forward(layer, cfg, x)
    live = layers.feed_forward(layer, cfg, x, live_columns=1)
    np.testing.assert_array_equal(np.asarray(live[:, 0]), np.asarray(full[:, 0]))
    assert not np.asarray(live[:, 1]).any()
    jaxpr = jax.make_jaxpr(functools.partial(layers.feed_forward, layer, cfg, live_columns=1))(x)
    top_k_rows = [eqn.invars[0].aval.shape[0] for eqn in jaxpr.jaxpr.eqns if eqn.primitive.name == "top_k"]
    assert top_k_rows == [3], top_k_rows


def test_an_moe_model_decodes_the_same_with_the_inert_column():
    """decode_tokens=2 (the GPU default) on a Qwen3.5-MoE model: the MoE skips the inert column and
    every greedy token equals the one-token step's."""
    import dataclasses

    import jaxspec

    model = jaxspec.load("demo:qwen3_5_moe", cache_dir=None, dtype="float32", kernels="xla", max_model_len=64,
                         max_num_seqs=2, prefill_chunk=16)
    prompts = [[5, 9, 13, 2, 7], [11, 3, 3, 8]]
    one = jaxspec.generate(dataclasses.replace(model, decode_tokens=1, _engines={}), prompts, max_new_tokens=12)
    two = jaxspec.generate(dataclasses.replace(model, decode_tokens=2, _engines={}), prompts, max_new_tokens=12)
    assert two.token_ids == one.token_ids
