"""Input projections packed into one weight per layer, for the one-device Pallas path.

A GDN layer projects its input four ways: qkv (the conv channels, grouped per key head), z (the
gated norm's gate), b and a (one column per value head each). Kept apart, XLA on the GPU runs qkv
and z as one Triton gemm that concatenates the two weights inside it, and b and a as two more
kernels; packed at load into one weight `in_proj` [H, conv_dim + value_dim + 2 HV] ([qkv | z | b |
a] columns), the layer runs one plain gemm (cuBLAS's matrix-vector kernel at one or two rows) and
the conv and recurrence kernels read their channels of its output in place (docs/benchmarks.md,
"Packed GDN projection").

The SwiGLU MLP (a dense layer's, and a MoE layer's shared expert) projects its input twice, gate
and up. Kept apart, XLA merges the two dots into one whose weight is the concatenation [gate | up],
and at a prefill chunk's rows (measured at 512) it copies both weights into that concatenation on
every call: 100 MB per Qwen3.5-2B layer, 25 us on an H200. Packed at load into `gate_up` [H, 2 I],
the MLP runs one gemm and splits its output (docs/benchmarks.md, "Prefill: conv on the grid, packed
MLP").

Full attention projects its input three ways, q, k and v. Packed at load into `qkv` [H, Cq + 2 Ck]
(and their biases, where the checkpoint has them, into `qkv_bias`), the layer's input norm runs
inside that one projection (ops.fused_linear) and the QK-norm / RoPE / KV-write prologue reads the
q, k and v columns of its output in place; unpacked, the Pallas path would concatenate the three
weights on every call.

`Model` packs its params when its kernels resolve to Pallas on one device (`packs`). Everything
that writes weights out (`jaxspec.save`, the HF export) unpacks first, so saved files keep the
canonical layout and load under any kernels or mesh; a sharded model is never packed (its qkv, z,
b, a columns are sharded per head, gate and up per column block, each on its own).
"""

import jax.numpy as jnp

from jaxspec import ops
from jaxspec.config import ModelConfig

PARTS = ("qkv", "z", "b", "a")
PACKED = "in_proj"
MLP_PARTS = ("gate", "up")
MLP_PACKED = "gate_up"
ATTN_PARTS = ("q", "k", "v")
ATTN_PACKED = "qkv"
ATTN_BIAS = "qkv_bias"


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


def _split_columns(y, widths_: tuple[int, ...], names: tuple[str, ...]) -> dict:
    """{name: its columns} of y's last axis, cut into consecutive widths."""
    out, at = {}, 0
    for name, width in zip(names, widths_, strict=True):
        out[name], at = y[..., at:at + width], at + width
    return out


def split(y, cfg: ModelConfig) -> dict:
    """{part: its columns} of an array whose last axis holds the packed GDN columns (the weight, or a
    projection output)."""
    return _split_columns(y, widths(cfg), PARTS)


def packs(cfg: ModelConfig, kernels: str) -> bool:
    """Whether a model with this config and kernels choice runs packed input projections."""
    return cfg.mesh is None and ops.resolve_kernels(kernels) == "pallas"


def is_packed(gdn: dict) -> bool:
    return PACKED in gdn


def _packed(params: dict, parts: tuple[str, ...], name: str) -> dict:
    """params with the weights `parts` replaced by their column concatenation `name` (as is when packed)."""
    if name in params:
        return params
    out = {key: value for key, value in params.items() if key not in parts}
    out[name] = jnp.concatenate([params[part] for part in parts], axis=1)
    return out


def _unpacked(params: dict, name: str, parts: dict) -> dict:
    """params with the packed weight `name` replaced by `parts` ({part: its columns})."""
    return {**{key: value for key, value in params.items() if key != name}, **parts}


def pack_gdn(gdn: dict) -> dict:
    """One GDN layer's params with qkv, z, b, a replaced by in_proj (a packed layer is returned as is)."""
    return _packed(gdn, PARTS, PACKED)


def unpack_gdn(gdn: dict, cfg: ModelConfig) -> dict:
    """One GDN layer's params in the canonical layout (qkv, z, b, a), from either layout."""
    return _unpacked(gdn, PACKED, split(gdn[PACKED], cfg)) if is_packed(gdn) else gdn


def is_packed_mlp(mlp: dict) -> bool:
    return MLP_PACKED in mlp


def pack_mlp(mlp: dict) -> dict:
    """A SwiGLU MLP's params with gate and up [H, I] replaced by gate_up [H, 2 I] (packed: as is)."""
    return _packed(mlp, MLP_PARTS, MLP_PACKED)


def unpack_mlp(mlp: dict) -> dict:
    """A SwiGLU MLP's params in the canonical layout (gate, up), from either layout."""
    if not is_packed_mlp(mlp):
        return mlp
    return _unpacked(mlp, MLP_PACKED, dict(zip(MLP_PARTS, split_mlp(mlp[MLP_PACKED]), strict=True)))


def split_mlp(h):
    """(gate, up) projections from the packed MLP gemm's output h [..., 2 I]."""
    inter = h.shape[-1] // 2
    return h[..., :inter], h[..., inter:]


def attention_widths(cfg: ModelConfig) -> tuple[int, ...]:
    """Columns of q (with the output gate's, per head, where gated), k and v, in ATTN_PARTS order."""
    q_out = cfg.num_attention_heads * cfg.head_dim * (2 if cfg.attn_output_gate else 1)
    return q_out, cfg.num_key_value_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim


def is_packed_attention(attn: dict) -> bool:
    return ATTN_PACKED in attn


def pack_attention(attn: dict) -> dict:
    """An attention layer's params with q, k, v (and q_bias, k_bias, v_bias) replaced by qkv (and
    qkv_bias); a packed layer is returned as is."""
    if is_packed_attention(attn):
        return attn
    biases = [part + "_bias" for part in ATTN_PARTS]
    out = _packed(attn, ATTN_PARTS, ATTN_PACKED)
    if any(name in attn for name in biases):
        out = {key: value for key, value in out.items() if key not in biases}
        out[ATTN_BIAS] = jnp.concatenate([attn.get(name, jnp.zeros((attn[part].shape[1],), attn[part].dtype))
                                          for part, name in zip(ATTN_PARTS, biases, strict=True)])
    return out


def unpack_attention(attn: dict, cfg: ModelConfig) -> dict:
    """An attention layer's params in the canonical layout (q, k, v and their biases), from either layout."""
    if not is_packed_attention(attn):
        return attn
    widths_ = attention_widths(cfg)
    parts = _split_columns(attn[ATTN_PACKED], widths_, ATTN_PARTS)
    if ATTN_BIAS in attn:
        parts.update(_split_columns(attn[ATTN_BIAS], widths_, tuple(part + "_bias" for part in ATTN_PARTS)))
    return {**{key: value for key, value in attn.items() if key not in (ATTN_PACKED, ATTN_BIAS)}, **parts}


def project_attention(p: dict, cfg: ModelConfig, x):
    """The attention input projections (q, k, v) of x [..., H] from either layout, biases added."""
    if is_packed_attention(p):
        y = x @ p[ATTN_PACKED]
        parts = _split_columns(y if ATTN_BIAS not in p else y + p[ATTN_BIAS], attention_widths(cfg), ATTN_PARTS)
        return tuple(parts[name] for name in ATTN_PARTS)
    return tuple(x @ p[name] if p.get(name + "_bias") is None else x @ p[name] + p[name + "_bias"]
                 for name in ATTN_PARTS)


def _map_layer(layer: dict, gdn_fn, mlp_fn, attn_fn) -> dict:
    """The layer with gdn_fn applied to its GDN params, attn_fn to its attention and mlp_fn to its
    dense MLP or shared expert."""
    out = dict(layer)
    if "gdn" in out:
        out["gdn"] = gdn_fn(out["gdn"])
    if "attn" in out:
        out["attn"] = attn_fn(out["attn"])
    if "mlp" in out:
        out["mlp"] = mlp_fn(out["mlp"])
    if "shared" in out.get("moe", {}):
        out["moe"] = dict(out["moe"], shared=mlp_fn(out["moe"]["shared"]))
    return out


def pack(params: dict) -> dict:
    """Packs every layer of `params` in place (and returns it): layer by layer, each layer's
    unpacked weights are dropped before the next is packed, so packing costs one layer's weight in
    memory, not the whole model's. A model sharing this params tree (dataclasses.replace) sees the
    packed layout, which every path reads."""
    for i, layer in enumerate(params["layers"]):
        params["layers"][i] = _map_layer(layer, pack_gdn, pack_mlp, pack_attention)
    return params


def unpack(params: dict, cfg: ModelConfig) -> dict:
    """A params tree with every layer in the canonical layout (new slices of packed weights)."""
    layers = [_map_layer(layer, lambda gdn: unpack_gdn(gdn, cfg), unpack_mlp, lambda attn: unpack_attention(attn, cfg))
              for layer in params["layers"]]
    return dict(params, layers=layers)


def is_packed_layer(layer: dict) -> bool:
    """Whether any of the layer's projections are packed."""
    mlps = (layer.get("mlp"), layer.get("moe", {}).get("shared"))
    return (("gdn" in layer and is_packed(layer["gdn"])) or ("attn" in layer and is_packed_attention(layer["attn"]))
            or any(m is not None and is_packed_mlp(m) for m in mlps))


def project(p: dict, cfg: ModelConfig, x):
    """The GDN input projections of x [..., H] from either layout: (qkv, z, b, a) with qkv [..., conv_dim],
    z [..., value_dim], b and a [..., HV]. Packed, one gemm and four slices of its output."""
    parts = split(x @ p[PACKED], cfg) if is_packed(p) else {name: x @ p[name] for name in PARTS}
    return tuple(parts[name] for name in PARTS)
