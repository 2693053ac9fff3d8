"""Engine memory accounting (issue 3): the memory plan is what gets allocated, and a plan that does not
fit its budget is refused before anything is allocated, naming needed vs available bytes and the
largest component. Also model-level GDN invariants on the hybrid demo families."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec import cache
from jaxspec.config import EngineConfig
from jaxspec.engine import Engine, make_batch
from jaxspec.models.model import forward
from tests.demo_models import NEW_TOKENS, SETTINGS, assert_idle, demo_model, one_at_a_time, prompts


def nbytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def expected_plan(model, ecfg: EngineConfig) -> dict[str, int]:
    """docs/architecture.md's cache shapes, written out independently of cache.py."""
    c, item = model.config, np.dtype(model.dtype).itemsize
    n_attn, n_gdn = c.layer_types.count("full_attention"), c.layer_types.count("linear_attention")
    kv = 2 * n_attn * ecfg.total_pages * ecfg.page_size * c.num_key_value_heads * c.head_dim * item
    slots = 1 + ecfg.max_num_seqs * (1 + ecfg.max_num_speculative_tokens)
    state = n_gdn * slots * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4
    conv_dim = 2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim
    K, k = c.linear_conv_kernel_dim, ecfg.max_num_speculative_tokens
    lines, width = (slots, K - 1) if ecfg.conv_per_state_slot else (1 + ecfg.max_num_seqs, K - 1 + k)
    conv = n_gdn * lines * width * conv_dim * item
    return {"weights": nbytes(model.params), "kv_pages": kv, "gdn_state": state, "conv_windows": conv}


@pytest.mark.parametrize("family,k,per_slot", [("qwen3", 0, False), ("qwen3_5", 0, False), ("qwen3_5", 3, False),
                                               ("qwen3_5", 2, True), ("qwen3_next", 2, False)])
def test_memory_plan_equals_allocated_bytes(family, k, per_slot):
    model = demo_model(family)
    ecfg = EngineConfig(max_num_seqs=3, max_model_len=40, page_size=8, max_num_speculative_tokens=k,
                        conv_per_state_slot=per_slot)
    engine = Engine(model, ecfg)
    allocated = {"weights": nbytes(model.params), "kv_pages": nbytes(engine.caches["kv"]),
                 "gdn_state": nbytes(engine.caches["ssm"]), "conv_windows": nbytes(engine.caches["conv"])}
    assert engine.memory_plan == allocated == expected_plan(model, ecfg)
    assert (allocated["gdn_state"] > 0) == model.config.is_hybrid
    for pool in engine.caches["ssm"]:
        assert pool.dtype == np.float32 and pool.shape[0] == 1 + 3 * (1 + k)  # null slot + (1+k) per request


def test_over_budget_engine_is_refused_before_allocation(monkeypatch):
    """Refused with needed vs available bytes and the largest component; nothing allocated; the model
    still generates what it generated before."""
    model = demo_model("qwen3_5")
    before = one_at_a_time("qwen3_5")  # computed before the refusal, also when this test runs first
    ecfg = EngineConfig(max_num_seqs=64, max_model_len=4096, page_size=16)
    plan = expected_plan(model, ecfg)
    needed, budget = sum(plan.values()), sum(plan.values()) - 1
    largest = max(plan, key=plan.get)
    assert largest == "kv_pages"
    monkeypatch.setattr(cache, "allocate", lambda *a: pytest.fail("allocated caches for a refused plan"))
    with pytest.raises(cache.MemoryBudgetError) as err:
        Engine(model, ecfg, memory_budget=budget)
    message = str(err.value)
    assert f"needs {needed} bytes" in message and f"only {budget} bytes" in message
    assert re.search(rf"largest component is {largest} \({plan[largest]} bytes\)", message)
    monkeypatch.undo()
    assert jaxspec.generate(model, prompts(), max_new_tokens=NEW_TOKENS).token_ids == before
    assert_idle(model)


def test_load_memory_budget_is_checked_at_load_and_at_engine_creation():
    model = demo_model("qwen3_5")
    fits = sum(model.engine().memory_plan.values())
    with pytest.raises(cache.MemoryBudgetError, match=rf"only {fits - 1} bytes .* largest component is weights"):
        jaxspec.load("demo:qwen3_5", **SETTINGS, memory_budget=fits - 1)
    budgeted = jaxspec.load("demo:qwen3_5", **SETTINGS, memory_budget=fits)
    assert budgeted.memory_budget == fits
    assert jaxspec.generate(budgeted, prompts(), max_new_tokens=NEW_TOKENS).token_ids == one_at_a_time("qwen3_5")
    engine = budgeted.engine()
    with pytest.raises(cache.MemoryBudgetError, match="largest component is weights"):
        budgeted.engine(2)  # GDN state slots for k = 2 no longer fit
    assert budgeted.engine() is engine  # the refusal kept the working engine
    result = jaxspec.generate(budgeted, prompts()[:1], max_new_tokens=NEW_TOKENS)
    assert result.token_ids == one_at_a_time("qwen3_5")[:1]


@pytest.mark.parametrize("budget", [0, -5, 1.5e9, "1GB"])
def test_bad_memory_budget(budget):
    with pytest.raises(ValueError, match=re.escape(f"memory_budget={budget!r} must be a positive integer")):
        jaxspec.load("demo:qwen3", **SETTINGS, memory_budget=budget)


# ---- GDN model-level invariants ----------------------------------------------------------------

@pytest.mark.parametrize("kernels", ["xla", "pallas"])
def test_verify_stores_no_snapshot_for_inert_tokens(kernels):
    """A verify row of T = 4 with 2 valid tokens writes the states after those 2 into its slots base,
    base + 1 and leaves base + 2, base + 3 as they were, as a padding row leaves the null slot and
    every other request's slots: inert states are never read (docs/speculation.md#gdn-rollback)."""
    model = demo_model("qwen3_5")
    cfg, ecfg, T = model.config, model.engine_config(3), 4
    caches = jax.tree.map(lambda x: jax.random.normal(jax.random.PRNGKey(1), x.shape).astype(x.dtype),
                          cache.allocate(cfg, ecfg, model.dtype))
    tables = jnp.asarray(1 + np.arange(2)[:, None] * ecfg.pages_per_seq + np.arange(ecfg.pages_per_seq), jnp.int32)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, T)), jnp.int32)
    # row 0: request in engine slot 2 at position 5, its previous round emitted 1; row 1: padding
    batch = make_batch(tokens, jnp.asarray([5, 0], jnp.int32), jnp.asarray([2, 0], jnp.int32), tables,
                       jnp.asarray([2, 0], jnp.int32), jnp.ones((3,), jnp.int32), ecfg)
    step = jax.jit(functools.partial(forward, cfg=cfg, mode="verify", kernels=kernels, last_only=False))
    _, _, new = step(model.params, caches=caches, batch=batch)
    base = int(batch.state_write[0])
    assert base == 1 + ecfg.state_slots_per_seq
    for before, after in zip(caches["ssm"], new["ssm"], strict=True):
        before, after = np.asarray(before), np.asarray(after)
        assert not np.array_equal(after[base:base + 2], before[base:base + 2])  # the valid tokens' states
        untouched = np.r_[0:base, base + 2:len(before)]
        np.testing.assert_array_equal(after[untouched], before[untouched])


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_prefill_in_chunks_then_decode_equals_one_full_forward(family):
    """generate prefills a 35-token prompt in three chunks, then decodes token by token; scoring
    prompt + generated tokens by chunked prefill alone predicts the same tokens, with clear margins."""
    model = demo_model(family)
    prompt = prompts()[-1]
    generated = jaxspec.generate(model, [prompt], max_new_tokens=NEW_TOKENS).token_ids[0]
    logits = jaxspec.score(model, prompt + generated[:-1])[len(prompt) - 1:]  # [NEW_TOKENS, V]
    assert logits.argmax(-1).tolist() == generated
    top2 = np.sort(logits, axis=-1)[:, -2:]
    assert np.min(top2[:, 1] - top2[:, 0]) > 1e-4  # no near-tie that could hide a mismatch
