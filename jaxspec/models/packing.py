"""The GDN input projections packed into one weight, for the one-device Pallas path.

A GDN layer projects its input four ways: qkv (the conv channels, grouped per key head), z (the
gated norm's gate), b and a (one column per value head each). Kept apart, XLA on the GPU runs qkv
and z as one Triton gemm that concatenates the two weights inside it, and b and a as two more
kernels; packed at load into one weight `in_proj` [H, conv_dim + value_dim + 2 HV] ([qkv | z | b |
a] columns), the layer runs one plain gemm (cuBLAS's matrix-vector kernel at one or two rows) and
the conv and recurrence kernels read their channels of its output in place (docs/benchmarks.md,
"Packed GDN projection").

`Model` packs its params when its kernels resolve to Pallas on one device (`packs`). Everything
that writes weights out (`jaxspec.save`, the HF export) unpacks first, so saved files keep the
canonical layout and load under any kernels or mesh; a sharded model is never packed (its qkv, z,
b, a columns are sharded per head, each on its own).
"""

import jax.numpy as jnp

from jaxspec import ops
from jaxspec.config import ModelConfig

PARTS = ("qkv", "z", "b", "a")
PACKED = "in_proj"


def widths(cfg: ModelConfig) -> tuple[int, ...]:
    """Columns of qkv, z, b and a, in PARTS order."""
    hv = cfg.linear_num_value_heads
    return cfg.gdn_conv_dim, cfg.gdn_value_dim, hv, hv


def offsets(cfg: ModelConfig) -> dict[str, int]:
    """First column of each part in the packed weight."""
    starts, at = {}, 0
    for name, width in zip(PARTS, widths(cfg), strict=True):
        starts[name], at = at, at + width
    return starts


def split(y, cfg: ModelConfig) -> dict:
    """{part: its columns} of an array whose last axis holds the packed columns (the weight, or a
    projection output)."""
    starts = offsets(cfg)
    return {name: y[..., starts[name]:starts[name] + width] for name, width in zip(PARTS, widths(cfg), strict=True)}


def packs(cfg: ModelConfig, kernels: str) -> bool:
    """Whether a model with this config and kernels choice runs packed GDN projections."""
    return cfg.mesh is None and ops.resolve_kernels(kernels) == "pallas"


def is_packed(gdn: dict) -> bool:
    return PACKED in gdn


def pack_gdn(gdn: dict) -> dict:
    """One GDN layer's params with qkv, z, b, a replaced by in_proj (a packed layer is returned as is)."""
    if is_packed(gdn):
        return gdn
    out = {key: value for key, value in gdn.items() if key not in PARTS}
    out[PACKED] = jnp.concatenate([gdn[name] for name in PARTS], axis=1)
    return out


def unpack_gdn(gdn: dict, cfg: ModelConfig) -> dict:
    """One GDN layer's params in the canonical layout (qkv, z, b, a), from either layout."""
    if not is_packed(gdn):
        return gdn
    return {**{key: value for key, value in gdn.items() if key != PACKED}, **split(gdn[PACKED], cfg)}


def pack(params: dict) -> dict:
    """Packs every GDN layer of `params` in place (and returns it): layer by layer, each layer's
    unpacked weights are dropped before the next is packed, so packing costs one layer's weight in
    memory, not the whole model's. A model sharing this params tree (dataclasses.replace) sees the
    packed layout, which every path reads."""
    for layer in params["layers"]:
        if "gdn" in layer:
            layer["gdn"] = pack_gdn(layer["gdn"])
    return params


def unpack(params: dict, cfg: ModelConfig) -> dict:
    """A params tree with every GDN layer in the canonical layout (new slices of packed weights)."""
    layers = [dict(layer, gdn=unpack_gdn(layer["gdn"], cfg)) if "gdn" in layer else layer
              for layer in params["layers"]]
    return dict(params, layers=layers)


def project(p: dict, cfg: ModelConfig, x):
    """The GDN input projections of x [..., H] from either layout: (qkv, z, b, a) with qkv [..., conv_dim],
    z [..., value_dim], b and a [..., HV]. Packed, one gemm and four slices of its output."""
    parts = split(x @ p[PACKED], cfg) if is_packed(p) else {name: x @ p[name] for name in PARTS}
    return tuple(parts[name] for name in PARTS)
