"""The decoder trunk shared by all families: embed -> layers (attention or GDN mixer, MLP or MoE) ->
final norm -> logits. Which mixer and MLP a layer uses comes from the config (layer_types,
mlp_kinds), so Qwen3, Qwen3-MoE, Qwen3.5 (dense / MoE) and Qwen3-Next share this one function.

The engine jits `forward` at the edge and donates the caches; inside, each decoder layer is a nested
jit (`_layer`), traced and lowered once per distinct layer shape.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxspec.config import FULL, ModelConfig
from jaxspec.models import layers


@jax.tree_util.register_dataclass
@dataclass
class StepBatch:
    """One step's inputs; every field is a traced array (docs/architecture.md)."""

    tokens: jax.Array  # [R, T] int32
    start_pos: jax.Array  # [R] int32, tokens already cached
    num_valid: jax.Array  # [R] int32, real tokens in the row (0 = padding row)
    block_tables: jax.Array  # [R, P] int32, KV page ids (0 = null page)
    state_read: jax.Array  # [R] int32, GDN state slot holding the start state (0 = null)
    state_write: jax.Array  # [R] int32, slot for the state after token 0; token t -> state_write + t (0 = null)
    conv_read: jax.Array  # [R] int32, conv line holding the window (0 = null)
    conv_offset: jax.Array  # [R] int32, window start inside the line (num_accepted - 1)
    conv_write: jax.Array  # [R] int32, conv line receiving the new window (0 = null)


def logits_from_hidden(params, cfg: ModelConfig, x):
    """x [..., H] -> float32 logits [..., V] through lm_head (or the tied embedding)."""
    w = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
    return (x @ w).astype(jnp.float32)


def decoder_layer(layer, cfg: ModelConfig, i: int, x, batch: StepBatch, caches: dict, *,
                  mode: str, kernels: str, live_columns: int | None = None):
    """One pre-norm decoder layer; returns (x, caches) with this layer's cache entry updated.

    The layer runs as a nested jit (`_layer`) of its own params, input and cache entry, so its body
    is traced and lowered once per distinct layer shape instead of once per layer: a 36-layer model
    lowers its Pallas kernels once, not 36 times, which is most of a warm start's tracing and
    lowering (docs/benchmarks.md, "Compile and start-up"). XLA inlines the calls: the optimised HLO
    has none left."""
    run = functools.partial(_layer, cfg=cfg, mode=mode, kernels=kernels, live_columns=live_columns)
    if cfg.layer_types[i] == FULL:
        j = cfg.attention_layers.index(i)
        x, (caches["kv"][j],) = run(layer, x, batch, (caches["kv"][j],), mixer=FULL)
    else:
        j = cfg.gdn_layers.index(i)
        x, (caches["ssm"][j], caches["conv"][j]) = run(layer, x, batch, (caches["ssm"][j], caches["conv"][j]),
                                                       mixer=cfg.layer_types[i])
    return x, caches


@functools.partial(jax.jit, static_argnames=("cfg", "mixer", "mode", "kernels", "live_columns"))
def _layer(layer, x, batch: StepBatch, cache: tuple, *, cfg: ModelConfig, mixer: str, mode: str, kernels: str,
           live_columns: int | None):
    # The norms and residual adds go into the projections beside them (layers.fused_projection).
    if mixer == FULL:
        x, kv = layers.attention(layer["attn"], cfg, x, batch, cache[0], kernels, residual=x, norm=layer["input_norm"])
        cache = (kv,)
    else:
        x, ssm, conv = layers.gated_delta_net(layer["gdn"], cfg, x, batch, *cache, mode=mode, kernels=kernels,
                                              norm=layer["input_norm"], residual=x)
        cache = (ssm, conv)
    return layers.residual_feed_forward(layer, cfg, x, layer["post_norm"], live_columns, kernels), cache


@layers.weight_precision
def forward(params, cfg: ModelConfig, caches: dict, batch: StepBatch, *, mode: str, kernels: str,
            last_only: bool, taps: tuple[int, ...] = (), live_columns: int | None = None):
    """Run the trunk over batch.tokens [R, T].

    Returns (logits, hidden, caches): logits [R, T, V] float32 (or [R, 1, V] at each row's last valid
    token when last_only), updated caches, and hidden at every position (dead code when unused):
    without taps, [R, T, H] after the final norm (the MTP input); with taps (static layer ids),
    [R, T, len(taps) * H], the residual stream after each listed decoder layer, concatenated in
    the order given (docs/speculation.md#taps).
    mode: "prefill" (chunked GDN, final state kept) or "verify" (GDN snapshot per token).
    live_columns (static): columns past it in every row are inert, never read (layers.feed_forward).
    """
    caches = {name: list(entries) for name, entries in caches.items()}
    x = params["embed"][batch.tokens]  # [R, T, H]
    tapped = {}
    for i, layer in enumerate(params["layers"]):
        x, caches = decoder_layer(layer, cfg, i, x, batch, caches, mode=mode, kernels=kernels,
                                  live_columns=live_columns)
        if i in taps:
            tapped[i] = x
    final = layers.rms_norm(x, params["norm"], cfg.rms_norm_eps, cfg.zero_centered_norm)
    x = final
    if last_only:
        last = jnp.maximum(batch.num_valid - 1, 0)  # [R]
        x = jnp.take_along_axis(final, last[:, None, None], axis=1)  # [R, 1, H]
    hidden = jnp.concatenate([tapped[i] for i in taps], axis=-1) if taps else final
    return logits_from_hidden(params, cfg, x), hidden, caches
