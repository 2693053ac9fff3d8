"""Hugging Face safetensors checkpoints <-> the jaxspec params pytree (docs/architecture.md).

Reading is our own parser of the safetensors format (8-byte little-endian header length, a JSON
header `{name: {dtype, shape, data_offsets}}`, then raw little-endian data), memory-mapped, so
bfloat16 works through ml_dtypes and a truncated file is reported with its name.

The HF-name maps are explicit: every params leaf has one HF tensor name, one expected HF shape and
one transform ("linear": HF [out, in] -> [in, out]; "raw": copied; "conv": [C, 1, K] -> [K, C]).
Two layouts need more than a per-tensor transform and have their own functions: MoE experts
(stacked from per-expert keys or from the fused `gate_up_proj`/`down_proj`) and Qwen3-Next's
grouped `in_proj_qkvz`/`in_proj_ba` (reordered into the flat GDN layout).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from tqdm.auto import tqdm

from jaxspec.config import FULL, ModelConfig

log = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PARAMS_SUBDIR = "params"  # save_params writes the orbax checkpoint to <directory>/params
PROGRESS_BYTES = 1 << 30  # show a progress bar when the checkpoint is larger than 1 GiB
VALID_DTYPES = ("auto", "bfloat16", "float32")

_ST_DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_NP_TO_ST = {v: k for k, v in _ST_DTYPES.items()}

Tensors = dict[str, np.ndarray]
Spec = dict[str, tuple[str, tuple[int, ...], str]]  # params key -> (HF name, HF shape, transform)


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or does not match the config; the message names the file
    or tensor."""


# ---- Reading and writing safetensors files ---------------------------------------------------------

def _read_header(path: Path) -> tuple[dict[str, Any], int]:
    """Returns (header dict, offset of the data section). Raises CheckpointError naming the file."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
        n = int.from_bytes(raw, "little")
        if n > size - 8:
            raise CheckpointError(f"{path}: corrupt or truncated safetensors file (header length {n} "
                                  f"exceeds the {size}-byte file)")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    return header, 8 + n


def _read_file(path: Path) -> Tensors:
    """All tensors of one .safetensors file as read-only numpy views of a memory map."""
    header, start = _read_header(path)
    header.pop("__metadata__", None)
    data_len = path.stat().st_size - start
    mm = np.memmap(path, dtype=np.uint8, mode="r", offset=start, shape=(data_len,)) if data_len else None
    out = {}
    for name, info in header.items():
        try:
            dtype, shape, (lo, hi) = _ST_DTYPES[info["dtype"]], tuple(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: corrupt header entry for tensor {name!r}: {info!r}") from None
        if not 0 <= lo <= hi <= data_len or hi - lo != int(np.prod(shape)) * dtype.itemsize:
            raise CheckpointError(f"{path}: truncated or corrupt: tensor {name!r} {info['dtype']}{list(shape)} "
                                  f"needs bytes [{lo}, {hi}) but the data section has {data_len} bytes")
        out[name] = np.ndarray(shape, dtype, buffer=mm, offset=lo) if hi > lo else np.zeros(shape, dtype)
    return out


def _shard_files(directory: Path) -> tuple[list[Path], dict[str, str]]:
    """The safetensors files of a checkpoint directory, in order, and the index's weight_map
    ({} without an index)."""
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint directory {str(directory)!r} does not exist")
    index = directory / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e!r})") from None
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (directory / s).is_file()]
        if missing:
            raise CheckpointError(f"{index} references shard {missing[0]!r}, which does not exist in {directory}")
        return [directory / s for s in shards], weight_map
    if (directory / SINGLE_FILE).is_file():
        return [directory / SINGLE_FILE], {}
    found = sorted(directory.glob("*.safetensors"))
    if not found:
        raise CheckpointError(f"no safetensors files in {directory} (expected {SINGLE_FILE} or {INDEX_FILE})")
    return found, {}


def read_checkpoint_tensors(path: str | os.PathLike) -> Tensors:
    """Reads a checkpoint directory (`model.safetensors`, or shards listed by
    `model.safetensors.index.json`), or a single .safetensors file, into {HF name: numpy array}.
    Arrays keep the stored dtype (bfloat16 as ml_dtypes.bfloat16) and are read-only memory-mapped
    views. Raises CheckpointError naming the missing directory / shard or the corrupt file."""
    path = Path(path)
    files, weight_map = ([path], {}) if path.suffix == ".safetensors" and path.is_file() else _shard_files(path)
    total = sum(f.stat().st_size for f in files)
    tensors: Tensors = {}
    for f in tqdm(files, desc="reading shards", unit="file", disable=total <= PROGRESS_BYTES):
        tensors.update(_read_file(f))
    absent = [name for name in weight_map if name not in tensors]
    if absent:
        raise CheckpointError(f"{INDEX_FILE} maps tensor {absent[0]!r} to shard {weight_map[absent[0]]!r}, "
                              f"which does not contain it")
    return tensors


def write_safetensors(tensors: Tensors, path: str | os.PathLike) -> Path:
    """Writes {name: array} to one .safetensors file (metadata format "pt", loadable by
    transformers). Written to a temporary file then renamed, so memory-mapped readers of an older
    file at `path` are never disturbed."""
    path = Path(path)
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    arrays, offset = [], 0
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        if a.dtype not in _NP_TO_ST:
            raise CheckpointError(f"tensor {name!r} has dtype {a.dtype}; valid: {sorted(map(str, _NP_TO_ST))}")
        header[name] = {"dtype": _NP_TO_ST[a.dtype], "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        arrays.append(a)
        offset += a.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # data section 8-byte aligned, as the reference writer does
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for a in arrays:
            f.write(a.tobytes())
    os.replace(tmp, path)
    return path


# ---- Explicit HF-name maps; `p` is the layer prefix ("model.layers.3.", "mtp.layers.0.") ----------

def _layer_norms(cfg: ModelConfig, p: str) -> Spec:
    H = cfg.hidden_size
    return {"input_norm": (p + "input_layernorm.weight", (H,), "raw"),
            "post_norm": (p + "post_attention_layernorm.weight", (H,), "raw")}


def _attn_spec(cfg: ModelConfig, p: str) -> Spec:
    """Attention; gated q_proj rows are per head [q_h | gate_h] and are kept in that order."""
    H, D, nH, nKV = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    q_out = nH * D * (2 if cfg.attn_output_gate else 1)
    spec = {"q": (p + "self_attn.q_proj.weight", (q_out, H), "linear"),
            "k": (p + "self_attn.k_proj.weight", (nKV * D, H), "linear"),
            "v": (p + "self_attn.v_proj.weight", (nKV * D, H), "linear"),
            "o": (p + "self_attn.o_proj.weight", (H, nH * D), "linear"),
            "q_norm": (p + "self_attn.q_norm.weight", (D,), "raw"),
            "k_norm": (p + "self_attn.k_norm.weight", (D,), "raw")}
    if cfg.attention_bias:
        spec.update({"q_bias": (p + "self_attn.q_proj.bias", (q_out,), "raw"),
                     "k_bias": (p + "self_attn.k_proj.bias", (nKV * D,), "raw"),
                     "v_bias": (p + "self_attn.v_proj.bias", (nKV * D,), "raw"),
                     "o_bias": (p + "self_attn.o_proj.bias", (H,), "raw")})
    return spec


def _gdn_common_spec(cfg: ModelConfig, p: str) -> Spec:
    H, HV, dv, K = cfg.hidden_size, cfg.linear_num_value_heads, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim
    return {"conv": (p + "linear_attn.conv1d.weight", (cfg.gdn_conv_dim, 1, K), "conv"),
            "A_log": (p + "linear_attn.A_log", (HV,), "raw"),
            "dt_bias": (p + "linear_attn.dt_bias", (HV,), "raw"),
            "norm": (p + "linear_attn.norm.weight", (dv,), "raw"),
            "out": (p + "linear_attn.out_proj.weight", (H, HV * dv), "linear")}


def _gdn_flat_spec(cfg: ModelConfig, p: str) -> Spec:
    """Qwen3.5 / 3.5-MoE: separate in_proj_qkv ([q | k | v] rows), in_proj_z, in_proj_b, in_proj_a."""
    H, HV = cfg.hidden_size, cfg.linear_num_value_heads
    return {"qkv": (p + "linear_attn.in_proj_qkv.weight", (cfg.gdn_conv_dim, H), "linear"),
            "z": (p + "linear_attn.in_proj_z.weight", (cfg.gdn_value_dim, H), "linear"),
            "b": (p + "linear_attn.in_proj_b.weight", (HV, H), "linear"),
            "a": (p + "linear_attn.in_proj_a.weight", (HV, H), "linear")}


def _next_grouped_names(cfg: ModelConfig, p: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Qwen3-Next: in_proj_qkvz rows grouped per key head [q_h | k_h | v_h (r*dv) | z_h (r*dv)],
    in_proj_ba rows grouped per key head [b_h (r) | a_h (r)]."""
    H, HV = cfg.hidden_size, cfg.linear_num_value_heads
    return {"qkvz": (p + "linear_attn.in_proj_qkvz.weight", (2 * cfg.gdn_key_dim + 2 * cfg.gdn_value_dim, H)),
            "ba": (p + "linear_attn.in_proj_ba.weight", (2 * HV, H))}


def _dense_mlp_spec(cfg: ModelConfig, p: str, inter: int, name: str = "mlp") -> Spec:
    H = cfg.hidden_size
    return {"gate": (f"{p}{name}.gate_proj.weight", (inter, H), "linear"),
            "up": (f"{p}{name}.up_proj.weight", (inter, H), "linear"),
            "down": (f"{p}{name}.down_proj.weight", (H, inter), "linear")}


def _moe_spec(cfg: ModelConfig, p: str) -> Spec:
    """Router and optional shared expert; the routed experts go through _load/_export_experts."""
    H, S = cfg.hidden_size, cfg.shared_expert_intermediate_size
    spec = {"router": (p + "mlp.gate.weight", (cfg.num_experts, H), "linear")}
    if S:
        spec["shared_gate"] = (p + "mlp.shared_expert_gate.weight", (1, H), "linear")
    return spec


def _expert_names(p: str, e: int) -> dict[str, str]:
    """Per-expert keys, as transformers 5.24 save_pretrained writes them for every Qwen MoE family."""
    return {k: f"{p}mlp.experts.{e}.{k}_proj.weight" for k in ("gate", "up", "down")}


def _fused_expert_names(p: str) -> dict[str, str]:
    """Fused keys (transformers-5 in-memory layout): gate_up_proj [E, 2I, H], down_proj [E, H, I]."""
    return {"gate_up": p + "mlp.experts.gate_up_proj", "down": p + "mlp.experts.down_proj"}


def _top_spec(cfg: ModelConfig) -> Spec:
    m = "model.language_model." if cfg.wrapped else "model."
    V, H = cfg.vocab_size, cfg.hidden_size
    spec = {"embed": (m + "embed_tokens.weight", (V, H), "raw"), "norm": (m + "norm.weight", (H,), "raw")}
    if not cfg.tie_word_embeddings:
        spec["lm_head"] = ("lm_head.weight", (V, H), "linear")
    return spec


def _layer_prefix(cfg: ModelConfig, i: int) -> str:
    return f"model.language_model.layers.{i}." if cfg.wrapped else f"model.layers.{i}."


def _mtp_spec(cfg: ModelConfig) -> Spec:
    H = cfg.hidden_size
    return {"pre_fc_norm_embedding": ("mtp.pre_fc_norm_embedding.weight", (H,), "raw"),
            "pre_fc_norm_hidden": ("mtp.pre_fc_norm_hidden.weight", (H,), "raw"),
            "fc": ("mtp.fc.weight", (H, 2 * H), "linear"),  # input is cat([embedding, hidden])
            "norm": ("mtp.norm.weight", (H,), "raw")}


# ---- HF -> params ----------------------------------------------------------------------------------

class _Source:
    """The checkpoint's tensors and the names consumed so far (to report tensors nobody used)."""

    def __init__(self, tensors: Tensors):
        self.tensors, self.used = tensors, set()

    def __contains__(self, name: str) -> bool:
        return name in self.tensors


def _take(src: _Source, name: str, shape: tuple[int, ...]) -> np.ndarray:
    if name not in src:
        raise CheckpointError(f"checkpoint is missing tensor {name!r} (expected shape {list(shape)})")
    t = src.tensors[name]
    src.used.add(name)
    if tuple(t.shape) != tuple(shape):
        raise CheckpointError(f"tensor {name!r} has shape {list(t.shape)}, expected {list(shape)}")
    return t


_TO_PARAMS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "linear": lambda t: t.T,                      # [out, in] -> [in, out]
    "raw": lambda t: t,
    "conv": lambda t: t[:, 0, :].T,               # [C, 1, K] -> [K, C]
}
_TO_HF: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "linear": lambda a: a.T,
    "raw": lambda a: a,
    "conv": lambda a: a.T[:, None, :],            # [K, C] -> [C, 1, K]
}


def _load_spec(src: _Source, spec: Spec, cast: Callable) -> dict[str, jax.Array]:
    return {key: cast(_TO_PARAMS[kind](_take(src, name, shape))) for key, (name, shape, kind) in spec.items()}


def _load_experts(cfg: ModelConfig, src: _Source, p: str, cast: Callable) -> dict[str, jax.Array]:
    """-> gate, up [E, H, Ie], down [E, Ie, H], from the fused or the per-expert layout."""
    E, H, Ie = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    fused = _fused_expert_names(p)
    if fused["gate_up"] in src:
        gate_up = _take(src, fused["gate_up"], (E, 2 * Ie, H))
        down = _take(src, fused["down"], (E, H, Ie))
        return {"gate": cast(gate_up[:, :Ie].transpose(0, 2, 1)), "up": cast(gate_up[:, Ie:].transpose(0, 2, 1)),
                "down": cast(down.transpose(0, 2, 1))}
    shapes = {"gate": (Ie, H), "up": (Ie, H), "down": (H, Ie)}
    out = {}
    for key, shape in shapes.items():
        per_expert = [_take(src, _expert_names(p, e)[key], shape).T for e in range(E)]
        out[key] = cast(np.stack(per_expert))
    return out


def _load_moe(cfg: ModelConfig, src: _Source, p: str, cast: Callable) -> dict[str, Any]:
    moe = _load_spec(src, _moe_spec(cfg, p), cast)
    moe.update(_load_experts(cfg, src, p, cast))
    if cfg.shared_expert_intermediate_size:
        spec = _dense_mlp_spec(cfg, p, cfg.shared_expert_intermediate_size, name="mlp.shared_expert")
        moe["shared"] = _load_spec(src, spec, cast)
    return moe


def _next_to_flat(cfg: ModelConfig, qkvz: np.ndarray, ba: np.ndarray) -> dict[str, np.ndarray]:
    """Grouped HF rows -> flat HF-orientation rows: qkv [conv_dim, H], z [HV*dv, H], b, a [HV, H].
    Value head j = h*r + i sits in key head h's group (j // r == h), so flattening the per-group
    v / z blocks in group order gives value heads in order."""
    HK, dk, dv, H = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.hidden_size
    r = cfg.linear_num_value_heads // HK
    g = qkvz.reshape(HK, 2 * dk + 2 * r * dv, H)
    q, k = g[:, :dk], g[:, dk:2 * dk]
    v, z = g[:, 2 * dk:2 * dk + r * dv], g[:, 2 * dk + r * dv:]
    qkv = np.concatenate([q.reshape(-1, H), k.reshape(-1, H), v.reshape(-1, H)])
    gba = ba.reshape(HK, 2 * r, H)
    return {"qkv": qkv, "z": z.reshape(-1, H), "b": gba[:, :r].reshape(-1, H), "a": gba[:, r:].reshape(-1, H)}


def _flat_to_next(cfg: ModelConfig, qkv: np.ndarray, z: np.ndarray, b: np.ndarray, a: np.ndarray):
    """Inverse of _next_to_flat: flat HF-orientation rows -> (in_proj_qkvz, in_proj_ba)."""
    HK, dk, dv, H = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.hidden_size
    r = cfg.linear_num_value_heads // HK
    kd = HK * dk
    q, k, v = qkv[:kd].reshape(HK, dk, H), qkv[kd:2 * kd].reshape(HK, dk, H), qkv[2 * kd:].reshape(HK, r * dv, H)
    qkvz = np.concatenate([q, k, v, z.reshape(HK, r * dv, H)], axis=1).reshape(-1, H)
    ba = np.concatenate([b.reshape(HK, r, H), a.reshape(HK, r, H)], axis=1).reshape(-1, H)
    return qkvz, ba


def _load_gdn(cfg: ModelConfig, src: _Source, p: str, cast: Callable) -> dict[str, jax.Array]:
    gdn = _load_spec(src, _gdn_common_spec(cfg, p), cast)
    if cfg.family == "qwen3_next":
        names = _next_grouped_names(cfg, p)
        flat = _next_to_flat(cfg, *(_take(src, n, s) for n, s in names.values()))
        gdn.update({key: cast(w.T) for key, w in flat.items()})
    else:
        gdn.update(_load_spec(src, _gdn_flat_spec(cfg, p), cast))
    return gdn


def _load_layer(cfg: ModelConfig, src: _Source, p: str, mixer: str, mlp: str, cast: Callable) -> dict:
    layer = _load_spec(src, _layer_norms(cfg, p), cast)
    if mixer == FULL:
        layer["attn"] = _load_spec(src, _attn_spec(cfg, p), cast)
    else:
        layer["gdn"] = _load_gdn(cfg, src, p, cast)
    if mlp == "moe":
        layer["moe"] = _load_moe(cfg, src, p, cast)
    else:
        layer["mlp"] = _load_spec(src, _dense_mlp_spec(cfg, p, cfg.intermediate_size), cast)
    return layer


def _mtp_mlp_kind(cfg: ModelConfig) -> str:
    return "moe" if cfg.num_experts > 0 else "dense"


def _mtp_layer_count(src: _Source) -> int:
    n = 0
    while f"mtp.layers.{n}.input_layernorm.weight" in src:
        n += 1
    return n


def _load_mtp(cfg: ModelConfig, src: _Source, cast: Callable) -> dict[str, Any]:
    mtp = _load_spec(src, _mtp_spec(cfg), cast)
    mtp["layers"] = [_load_layer(cfg, src, f"mtp.layers.{i}.", FULL, _mtp_mlp_kind(cfg), cast)
                     for i in range(_mtp_layer_count(src))]
    if not mtp["layers"]:
        raise CheckpointError("checkpoint has mtp.fc.weight but no mtp.layers.0.* decoder layer")
    return mtp


def resolve_dtype(cfg: ModelConfig, dtype: str) -> jnp.dtype:
    """"auto" -> cfg.torch_dtype; "bfloat16" / "float32" as named."""
    if dtype not in VALID_DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; valid: {', '.join(VALID_DTYPES)}")
    name = cfg.torch_dtype if dtype == "auto" else dtype
    if name not in ("bfloat16", "float32"):
        raise ValueError(f"config torch_dtype={name!r} (dtype='auto') is not supported; "
                         f"pass dtype='bfloat16' or 'float32'")
    return jnp.dtype(name)


def hf_to_params(cfg: ModelConfig, tensors: Tensors, dtype: str = "auto") -> dict[str, Any]:
    """HF tensors {name: [out, in] ...} -> params pytree of docs/architecture.md (jax arrays of
    `dtype`: "auto" = cfg.torch_dtype, "bfloat16" or "float32"). `model.visual.*` tensors are
    skipped; `mtp.*` tensors land in params["mtp"] when present. Raises CheckpointError naming a
    missing tensor or a tensor whose shape does not match the config."""
    target = resolve_dtype(cfg, dtype)

    def cast(t: np.ndarray) -> jax.Array:
        return jnp.asarray(np.asarray(t, dtype=target))

    src = _Source(tensors)
    params = _load_spec(src, _top_spec(cfg), cast)
    params["layers"] = [
        _load_layer(cfg, src, _layer_prefix(cfg, i), cfg.layer_types[i], cfg.mlp_kinds[i], cast)
        for i in tqdm(range(cfg.num_hidden_layers), desc="converting layers", unit="layer",
                      disable=_nbytes(tensors) <= PROGRESS_BYTES)]
    if "mtp.fc.weight" in src:
        params["mtp"] = _load_mtp(cfg, src, cast)
    elif cfg.mtp_num_hidden_layers:
        log.info("config has mtp_num_hidden_layers=%d but the checkpoint has no mtp.* weights",
                 cfg.mtp_num_hidden_layers)
    _report_unused(src)
    return params


def _report_unused(src: _Source) -> None:
    """Vision-tower tensors are expected leftovers (info); anything else is worth a warning."""
    unused = sorted(set(src.tensors) - src.used)
    visual = [n for n in unused if n.startswith("model.visual.")]
    other = [n for n in unused if not n.startswith("model.visual.")]
    if visual:
        log.info("skipping %d vision-tower tensors (model.visual.*): jaxspec serves the text model only",
                 len(visual))
    if other:
        log.warning("ignoring %d checkpoint tensors that the config does not use, e.g. %s",
                    len(other), ", ".join(other[:5]))


def _nbytes(tensors: Tensors) -> int:
    return sum(t.nbytes for t in tensors.values())


# ---- params -> HF (exact inverse of hf_to_params) --------------------------------------------------

def _export_spec(params: dict, spec: Spec, out: Tensors) -> None:
    for key, (name, shape, kind) in spec.items():
        t = np.ascontiguousarray(_TO_HF[kind](np.asarray(params[key])))
        if t.shape != shape:
            raise ValueError(f"params[{key!r}] exports to {name!r} with shape {list(t.shape)}, expected {list(shape)}")
        out[name] = t


def _export_experts(moe: dict, p: str, out: Tensors, fused: bool) -> None:
    gate, up, down = (np.asarray(moe[k]) for k in ("gate", "up", "down"))  # [E,H,Ie], [E,H,Ie], [E,Ie,H]
    if fused:
        names = _fused_expert_names(p)
        out[names["gate_up"]] = np.ascontiguousarray(np.concatenate([gate, up], axis=2).transpose(0, 2, 1))
        out[names["down"]] = np.ascontiguousarray(down.transpose(0, 2, 1))
        return
    for e in range(gate.shape[0]):
        names = _expert_names(p, e)
        for key, w in (("gate", gate[e]), ("up", up[e]), ("down", down[e])):
            out[names[key]] = np.ascontiguousarray(w.T)


def _export_layer(cfg: ModelConfig, layer: dict, p: str, out: Tensors, fused_experts: bool) -> None:
    _export_spec(layer, _layer_norms(cfg, p), out)
    if "attn" in layer:
        _export_spec(layer["attn"], _attn_spec(cfg, p), out)
    else:
        gdn = layer["gdn"]
        _export_spec(gdn, _gdn_common_spec(cfg, p), out)
        if cfg.family == "qwen3_next":
            flat = {k: np.asarray(gdn[k]).T for k in ("qkv", "z", "b", "a")}
            names = _next_grouped_names(cfg, p)
            qkvz, ba = _flat_to_next(cfg, **flat)
            out[names["qkvz"][0]], out[names["ba"][0]] = np.ascontiguousarray(qkvz), np.ascontiguousarray(ba)
        else:
            _export_spec(gdn, _gdn_flat_spec(cfg, p), out)
    if "moe" in layer:
        moe = layer["moe"]
        _export_spec(moe, _moe_spec(cfg, p), out)
        _export_experts(moe, p, out, fused_experts)
        if "shared" in moe:
            spec = _dense_mlp_spec(cfg, p, cfg.shared_expert_intermediate_size, name="mlp.shared_expert")
            _export_spec(moe["shared"], spec, out)
    else:
        _export_spec(layer["mlp"], _dense_mlp_spec(cfg, p, cfg.intermediate_size), out)


def params_to_hf(cfg: ModelConfig, params: dict[str, Any], fused_experts: bool = False) -> Tensors:
    """params pytree -> {HF name: numpy array in HF [out, in] orientation}, the exact inverse of
    hf_to_params (dtype kept). MoE experts are written per expert (`mlp.experts.{e}.*_proj.weight`,
    what transformers 5.24 save_pretrained writes) or, with fused_experts=True, as
    `mlp.experts.gate_up_proj [E, 2I, H]` / `mlp.experts.down_proj [E, H, I]`."""
    out: Tensors = {}
    _export_spec(params, _top_spec(cfg), out)
    if len(params["layers"]) != cfg.num_hidden_layers:
        raise ValueError(f"params has {len(params['layers'])} layers, config num_hidden_layers={cfg.num_hidden_layers}")
    for i, layer in enumerate(params["layers"]):
        _export_layer(cfg, layer, _layer_prefix(cfg, i), out, fused_experts)
    if "mtp" in params:
        _export_spec(params["mtp"], _mtp_spec(cfg), out)
        for i, layer in enumerate(params["mtp"]["layers"]):
            _export_layer(cfg, layer, f"mtp.layers.{i}.", out, fused_experts)
    return out


# ---- Orbax save / restore of the params pytree -----------------------------------------------------

def save_params(params: dict[str, Any], directory: str | os.PathLike) -> Path:
    """Saves params with orbax to <directory>/params (other files in `directory`, e.g. config.json,
    are left alone). Overwrite-safe: the new checkpoint is written beside the old one and swapped
    in only once complete. Returns the params path."""
    import orbax.checkpoint as ocp

    directory = Path(directory).absolute()
    directory.mkdir(parents=True, exist_ok=True)
    final, tmp, old = (directory / PARAMS_SUBDIR, directory / (PARAMS_SUBDIR + ".saving"),
                       directory / (PARAMS_SUBDIR + ".old"))
    for stale in (tmp, old):
        shutil.rmtree(stale, ignore_errors=True)
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(tmp, params)
    ckptr.wait_until_finished()
    ckptr.close()
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def restore_params(directory: str | os.PathLike) -> dict[str, Any]:
    """Restores params saved by save_params(params, directory) onto the default device, with the
    saved shapes and dtypes. Raises CheckpointError when <directory>/params does not exist."""
    import orbax.checkpoint as ocp

    path = Path(directory).absolute() / PARAMS_SUBDIR
    if not path.is_dir() and path.with_name(PARAMS_SUBDIR + ".old").is_dir():
        path = path.with_name(PARAMS_SUBDIR + ".old")  # a save_params interrupted mid-swap
    if not path.is_dir():
        raise CheckpointError(f"no saved params at {str(path)!r} (written by save_params)")
    ckptr = ocp.StandardCheckpointer()
    meta = ckptr.metadata(path)
    tree = getattr(meta, "item_metadata", meta)  # StepMetadata in newer orbax, the tree in older
    tree = getattr(tree, "tree", tree)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), tree)
    params = ckptr.restore(path, target)
    ckptr.close()
    return params
