"""Paged KV pools, GDN state slots and conv window lines: shapes, byte accounting, allocation, and a
host-side page allocator. Index 0 of every pool is reserved as the inert null entry."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxspec import sharding
from jaxspec.config import EngineConfig, ModelConfig


class MemoryBudgetError(ValueError):
    """A configuration whose memory plan does not fit the budget it was given."""


def cache_shapes(cfg: ModelConfig, ecfg: EngineConfig, dtype) -> dict:
    """ShapeDtypeStructs with the exact structure of the caches pytree, each with its sharding
    over cfg.mesh (KV pages by kv head, GDN state and conv lines by GDN head; none without a mesh)."""
    def shape(dims, dt, axes):
        return jax.ShapeDtypeStruct(dims, dt, sharding=sharding.named(cfg, axes))

    kv = shape((ecfg.total_pages, ecfg.page_size, sharding.kv_cache_heads(cfg), cfg.head_dim), dtype,
               sharding.KV_AXES)
    slots = 1 + ecfg.max_num_seqs * ecfg.state_slots_per_seq
    ssm = shape((slots, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim),
                jnp.float32, sharding.SSM_AXES)
    if ecfg.conv_per_state_slot:  # a window per state slot, advanced one token per step
        conv = shape((slots, cfg.linear_conv_kernel_dim - 1, cfg.gdn_conv_dim), dtype, sharding.CONV_AXES)
    else:  # one sliding line per request, read at offset num_emitted - 1
        line = (cfg.linear_conv_kernel_dim - 1) + ecfg.max_num_speculative_tokens
        conv = shape((1 + ecfg.max_num_seqs, line, cfg.gdn_conv_dim), dtype, sharding.CONV_AXES)
    return {
        "kv": [(kv, kv) for _ in cfg.attention_layers],
        "ssm": [ssm for _ in cfg.gdn_layers],
        "conv": [conv for _ in cfg.gdn_layers],
    }


def cache_bytes(cfg: ModelConfig, ecfg: EngineConfig, dtype) -> dict[str, int]:
    """Bytes of each cache component on one device, exactly as allocated."""
    shapes = cache_shapes(cfg, ecfg, dtype)
    return {
        "kv_pages": sum(sharding.shard_bytes(k) + sharding.shard_bytes(v) for k, v in shapes["kv"]),
        "gdn_state": sum(sharding.shard_bytes(s) for s in shapes["ssm"]),
        "conv_windows": sum(sharding.shard_bytes(s) for s in shapes["conv"]),
    }


def params_bytes(params) -> int:
    """Bytes of the params on one device (each leaf's shard)."""
    return sum(sharding.shard_bytes(x) for x in jax.tree_util.tree_leaves(params))


POOL_HEADROOM = 0.08  # of the budget, kept free for activations and executables when sizing the KV pool


def page_bytes(cfg: ModelConfig, ecfg: EngineConfig, dtype, extra_layers: int = 0) -> int:
    """Bytes one KV page costs on one device across every attention layer (K and V), plus
    `extra_layers` layers that share the target's page ids (the MTP head's)."""
    layers = len(cfg.attention_layers) + extra_layers
    heads = sharding.kv_cache_heads(cfg) // sharding.tp_size(cfg)
    return 2 * layers * ecfg.page_size * heads * cfg.head_dim * jnp.dtype(dtype).itemsize


def plan_pool(model, ecfg: EngineConfig, budget: int | None) -> int:
    """Pages for the KV pool (the null page included): what the budget leaves after the weights,
    the GDN state and conv slots of max_num_seqs requests and a headroom of POOL_HEADROOM, divided
    by the bytes of a page (the MTP head's KV, which shares page ids, included); never more than
    max_num_seqs requests of max_model_len can use. No budget (CPU): that maximum. A budget too
    small for even the weights also gets the maximum, so that check_budget refuses it by name."""
    full = 1 + ecfg.max_num_seqs * ecfg.pages_per_seq
    if budget is None:
        return full
    fixed = cache_bytes(model.config, ecfg, model.dtype)
    mtp_layers = len(model.params.get("mtp", {}).get("layers", ())) if isinstance(model.params, dict) else 0
    left = budget * (1 - POOL_HEADROOM) - params_bytes(model.params) - fixed["gdn_state"] - fixed["conv_windows"]
    pages = int(left // page_bytes(model.config, ecfg, model.dtype, mtp_layers))
    return full if pages < 2 else min(full, pages)


def device_memory_bytes() -> int | None:
    """Bytes one of this process's devices can hold, where the backend reports it (GPUs do; CPU does not)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    return stats.get("bytes_limit")


def budget_of(model) -> int | None:
    """The one answer to "how many bytes may this model's engines use": its memory_budget, else
    what the device reports (GPUs do; CPUs do not: None, no check)."""
    budget = getattr(model, "memory_budget", None)
    return budget if budget is not None else device_memory_bytes()


def check_budget(plan: dict[str, int], budget: int | None) -> None:
    """Refuse a memory plan that exceeds the budget, stating needed vs available bytes."""
    if budget is None:
        return
    needed = sum(plan.values())
    if needed > budget:
        parts = ", ".join(f"{k}={v / 2**20:.1f} MiB" for k, v in plan.items())
        largest = max(plan, key=plan.get)
        raise MemoryBudgetError(
            f"memory plan needs {needed} bytes ({needed / 2**30:.2f} GiB) but only {budget} bytes "
            f"({budget / 2**30:.2f} GiB) are available; the largest component is {largest} "
            f"({plan[largest]} bytes) of {parts}; lower max_num_seqs, max_model_len, "
            f"the number of speculative tokens, or num_pages")


@functools.cache
def allocate_executable(cfg: ModelConfig, ecfg: EngineConfig, dtype):
    """One jitted function producing every cache buffer (so allocation is a single executable that
    precompile can cache, not one eager op per shape)."""
    shapes = cache_shapes(cfg, ecfg, dtype)
    placed = {} if cfg.mesh is None else {"out_shardings": jax.tree_util.tree_map(lambda s: s.sharding, shapes)}
    return jax.jit(lambda: jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes), **placed)


def allocate(cfg: ModelConfig, ecfg: EngineConfig, dtype) -> dict:
    """Zero-filled caches (zeros keep padded reads finite; jnp.empty is uninitialised from jax 0.11)."""
    return allocate_executable(cfg, ecfg, jnp.dtype(dtype))()


@dataclass
class PageAllocator:
    """Free list over page ids 1..num_pages-1 (page 0 is the null page)."""

    num_pages: int

    def __post_init__(self):
        self._free = list(range(self.num_pages - 1, 0, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryBudgetError(f"need {n} KV pages but only {len(self._free)} are free "
                                    f"(pool of {self.num_pages} pages)")
        pages, self._free = self._free[-n:] if n else [], self._free[:len(self._free) - n]
        return pages[::-1]

    def free(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))
