"""Hugging Face safetensors checkpoints <-> the jaxspec params pytree (docs/architecture.md).

Reading goes through memory-mapped numpy views of each file (validated by the safetensors library
first): a weight is built lazily in params layout (`_Lazy`) and each device's shard reads only its
own bytes of the file (bfloat16 arrives as ml_dtypes.bfloat16); a corrupt or truncated file is
reported with its name. Writing (`write_safetensors`, for tests and tools) is our own.

The HF-name maps are explicit: every params leaf has one HF tensor name, one expected HF shape and
one transform ("linear": HF [out, in] -> [in, out]; "raw": copied; "conv": [C, 1, K] -> [K, C]).
Two layouts need more than a per-tensor transform and have their own functions: MoE experts
(stacked from per-expert keys or from the fused `gate_up_proj`/`down_proj`) and Qwen3-Next's
grouped `in_proj_qkvz`/`in_proj_ba`. GDN channels (qkv columns, conv) are stored grouped by key
head (`grouped_channels`), so a contiguous shard holds whole GVA groups.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from tqdm import tqdm

from jaxspec.config import FULL, ModelConfig
from jaxspec.models import packing

log = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PROGRESS_BYTES = 1 << 30  # show a progress bar when the checkpoint is larger than 1 GiB
READ_THREADS = min(8, os.cpu_count() or 1)  # tensors read and copied to the device(s) at once
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


# ---- Reading safetensors files: validated by the safetensors library, read through memory maps ---

def _open_file(path: Path) -> dict[str, np.ndarray]:
    """{name: read-only numpy view} of one .safetensors file, memory-mapped: nothing is read until a
    view's bytes are touched (bfloat16 as ml_dtypes.bfloat16). The safetensors library validates the
    file first (header, dtypes, data fully covered); a corrupt or truncated file raises
    CheckpointError naming it. The views, not the library's slicing reader, are what a load copies
    from: on the H200 host the slicing reader moved 0.96 GB/s and a Qwen3-4B warm start loaded its
    8 GB in 8.4 s; through the views it took 4.0-4.6 s (docs/benchmarks.md, "Compile and start-up")."""
    from safetensors import SafetensorError, safe_open

    try:
        names = list(safe_open(str(path), framework="numpy").keys())
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path}: corrupt or truncated safetensors file ({e})") from None
    start, header = read_header(path)
    data = np.memmap(path, np.uint8, mode="r", offset=start) if path.stat().st_size > start else np.empty(0, np.uint8)
    return tensor_views(data, header, names)


def read_header(path: str | os.PathLike) -> tuple[int, dict[str, Any]]:
    """(byte offset of the data section, the JSON header) of a .safetensors file."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        return 8 + size, json.loads(f.read(size))


def tensor_views(data: np.ndarray, header: dict[str, Any], names=None) -> dict[str, np.ndarray]:
    """{name: numpy view} of `names` (default: every tensor) over `data`, a safetensors file's data
    section as uint8 (a memory map, or bytes read into memory); bfloat16 as ml_dtypes.bfloat16."""
    names = [n for n in header if n != "__metadata__"] if names is None else names

    def view(entry) -> np.ndarray:
        lo, hi = entry["data_offsets"]
        return data[lo:hi].view(_ST_DTYPES[entry["dtype"]]).reshape(entry["shape"])

    return {name: view(header[name]) for name in names}


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


def open_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """A checkpoint directory (`model.safetensors`, or shards listed by `model.safetensors.index.json`)
    or a single .safetensors file as {HF name: memory-mapped view}; hf_to_params reads from it only what each
    device's shard of each weight needs. Raises CheckpointError naming the missing directory / shard
    or the corrupt file."""
    path = Path(path)
    files, weight_map = ([path], {}) if path.suffix == ".safetensors" and path.is_file() else _shard_files(path)
    tensors: dict[str, Any] = {}
    for f in files:
        tensors.update(_open_file(f))
    absent = [name for name in weight_map if name not in tensors]
    if absent:
        raise CheckpointError(f"{INDEX_FILE} maps tensor {absent[0]!r} to shard {weight_map[absent[0]]!r}, "
                              f"which does not contain it")
    return tensors


def read_checkpoint_tensors(path: str | os.PathLike) -> Tensors:
    """open_checkpoint, read whole: {HF name: numpy array} in the stored dtype (bfloat16 as
    ml_dtypes.bfloat16)."""
    return {name: _Lazy.of(t).full() for name, t in open_checkpoint(path).items()}


def write_safetensors(tensors: Tensors, path: str | os.PathLike) -> Path:
    """Writes {name: array} to one .safetensors file (metadata format "pt", loadable by
    transformers). Written to a temporary file then renamed, so memory-mapped readers of an older
    file at `path` are never disturbed."""
    path = Path(path)
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    arrays, offset = [], 0
    for name in sorted(tensors):
        a = np.require(tensors[name], requirements="C")  # C order; unlike ascontiguousarray, keeps 0-d as 0-d
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


# ---- Lazy tensors: a weight in params layout, read slice by slice ----------------------------------

def _norm_index(index, shape) -> tuple[slice, ...]:
    """A basic index (a tuple of slices, as make_array_from_callback passes) with explicit bounds."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(tuple(index)))
    out = []
    for i, n in zip(index, shape, strict=True):
        start, stop, step = i.indices(n)
        if step != 1:
            raise ValueError(f"only unit-step slices are read, got {i}")
        out.append(slice(start, stop))
    return tuple(out)


class _Lazy:
    """A tensor of a given shape whose values are read on demand: `lazy[index]` -> numpy, for a
    tuple of unit-step slices. Built from a stored tensor (a safetensors slice or a numpy array)
    by the transforms below, so a device reads only its shard's bytes of the checkpoint."""

    def __init__(self, shape, read: Callable[[tuple[slice, ...]], np.ndarray]):
        self.shape, self._read = tuple(int(n) for n in shape), read

    @classmethod
    def of(cls, stored) -> _Lazy:
        if isinstance(stored, _Lazy):
            return stored
        shape = stored.shape if hasattr(stored, "shape") else stored.get_shape()
        return cls(shape, lambda index: np.asarray(stored[index]))

    def __getitem__(self, index) -> np.ndarray:
        return self._read(_norm_index(index, self.shape))

    def full(self) -> np.ndarray:
        return self[()]

    def transpose(self, axes: tuple[int, ...]) -> _Lazy:
        inverse = np.argsort(axes)
        return _Lazy([self.shape[a] for a in axes],
                     lambda index: self[tuple(index[i] for i in inverse)].transpose(axes))

    def take(self, rows: np.ndarray, axis: int) -> _Lazy:
        """self gathered along `axis` at integer `rows`; each run of consecutive rows is one slice read."""
        rows = np.asarray(rows)
        shape = list(self.shape)
        shape[axis] = len(rows)

        def read(index):
            wanted = rows[index[axis]]
            cuts = np.flatnonzero(np.diff(wanted) != 1) + 1
            parts = []
            for run in np.split(wanted, cuts) if len(wanted) else []:
                sub = list(index)
                sub[axis] = slice(int(run[0]), int(run[-1]) + 1)
                parts.append(self[tuple(sub)])
            if not parts:
                return np.zeros([s.stop - s.start for s in index], self._dtype())
            return np.concatenate(parts, axis=axis)

        return _Lazy(shape, read)

    def _dtype(self):
        return self[tuple(slice(0, min(n, 1)) for n in self.shape)].dtype

    @staticmethod
    def stack(parts: list[_Lazy]) -> _Lazy:
        """[n, *shape] from n lazies of one shape."""
        return _Lazy([len(parts), *parts[0].shape],
                     lambda index: np.stack([parts[e][index[1:]] for e in range(len(parts))[index[0]]]))


_TO_PARAMS: dict[str, Callable[[_Lazy], _Lazy]] = {
    "linear": lambda t: t.transpose((1, 0)),      # [out, in] -> [in, out]
    "raw": lambda t: t,
    "conv": lambda t: _Lazy([t.shape[2], t.shape[0]],                     # [C, 1, K] -> [K, C]
                            lambda i: t[(i[1], slice(0, 1), i[0])][:, 0, :].T),
}
_TO_HF: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "linear": lambda a: a.T,
    "raw": lambda a: a,
    "conv": lambda a: a.T[:, None, :],            # [K, C] -> [C, 1, K]
}


# ---- HF -> params ----------------------------------------------------------------------------------

class _Source:
    """The checkpoint's tensors and the names consumed so far (to report tensors nobody used)."""

    def __init__(self, tensors):
        self.tensors, self.used = tensors, set()

    def __contains__(self, name: str) -> bool:
        return name in self.tensors


def _take(src: _Source, name: str, shape: tuple[int, ...]) -> _Lazy:
    if name not in src:
        raise CheckpointError(f"checkpoint is missing tensor {name!r} (expected shape {list(shape)})")
    t = _Lazy.of(src.tensors[name])
    src.used.add(name)
    if t.shape != tuple(shape):
        raise CheckpointError(f"tensor {name!r} has shape {list(t.shape)}, expected {list(shape)}")
    return t


def _load_spec(src: _Source, spec: Spec) -> dict[str, _Lazy]:
    return {key: _TO_PARAMS[kind](_take(src, name, shape)) for key, (name, shape, kind) in spec.items()}


def _load_experts(cfg: ModelConfig, src: _Source, p: str) -> dict[str, _Lazy]:
    """-> gate, up [E, H, Ie], down [E, Ie, H], from the fused or the per-expert layout."""
    E, H, Ie = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    fused = _fused_expert_names(p)
    if fused["gate_up"] in src:
        gate_up = _take(src, fused["gate_up"], (E, 2 * Ie, H))
        down = _take(src, fused["down"], (E, H, Ie))
        return {"gate": gate_up.take(np.arange(Ie), 1).transpose((0, 2, 1)),
                "up": gate_up.take(np.arange(Ie, 2 * Ie), 1).transpose((0, 2, 1)), "down": down.transpose((0, 2, 1))}
    shapes = {"gate": (Ie, H), "up": (Ie, H), "down": (H, Ie)}
    return {key: _Lazy.stack([_take(src, _expert_names(p, e)[key], shape).transpose((1, 0)) for e in range(E)])
            for key, shape in shapes.items()}


def _load_moe(cfg: ModelConfig, src: _Source, p: str) -> dict[str, Any]:
    moe = _load_spec(src, _moe_spec(cfg, p))
    moe.update(_load_experts(cfg, src, p))
    if cfg.shared_expert_intermediate_size:
        moe["shared"] = _load_spec(src, _dense_mlp_spec(cfg, p, cfg.shared_expert_intermediate_size,
                                                        name="mlp.shared_expert"))
    return moe


def grouped_channels(cfg: ModelConfig) -> np.ndarray:
    """The flat [q | k | v] channel (HF in_proj_qkv row, conv1d channel) of each channel of the
    grouped layout [q_h | k_h | v_h (r value heads)] per key head h (docs/architecture.md)."""
    HK, dk, dv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    r = cfg.linear_num_value_heads // HK
    h = np.arange(HK)[:, None]
    q, k = h * dk + np.arange(dk), HK * dk + h * dk + np.arange(dk)
    v = 2 * HK * dk + h * r * dv + np.arange(r * dv)
    return np.concatenate([q, k, v], axis=1).reshape(-1)


def _next_rows(cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Rows of Qwen3-Next's grouped in_proj_qkvz ([q_h | k_h | v_h | z_h] per key head h) and
    in_proj_ba ([b_h (r) | a_h (r)]) that make the grouped qkv, z, b and a. Value head j = h*r + i
    sits in key head h's group, so the per-group z / b / a blocks in group order are in head order."""
    HK, dk, dv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    r = cfg.linear_num_value_heads // HK
    g, h = 2 * dk + 2 * r * dv, np.arange(HK)[:, None]
    return {"qkv": (h * g + np.arange(2 * dk + r * dv)).reshape(-1),
            "z": (h * g + 2 * dk + r * dv + np.arange(r * dv)).reshape(-1),
            "b": (h * 2 * r + np.arange(r)).reshape(-1), "a": (h * 2 * r + r + np.arange(r)).reshape(-1)}


def _load_gdn(cfg: ModelConfig, src: _Source, p: str) -> dict[str, _Lazy]:
    """The GDN mixer with qkv / conv channels in the grouped layout (grouped_channels)."""
    common = _gdn_common_spec(cfg, p)
    conv_name, conv_shape, _ = common.pop("conv")
    gdn = _load_spec(src, common)
    gdn["conv"] = _TO_PARAMS["conv"](_take(src, conv_name, conv_shape).take(grouped_channels(cfg), 0))
    if cfg.family == "qwen3_next":
        names = _next_grouped_names(cfg, p)
        qkvz, ba = (_take(src, *names[key]) for key in ("qkvz", "ba"))
        for key, rows in _next_rows(cfg).items():
            gdn[key] = (qkvz if key in ("qkv", "z") else ba).take(rows, 0).transpose((1, 0))
    else:
        gdn.update(_load_spec(src, _gdn_flat_spec(cfg, p)))
        gdn["qkv"] = gdn["qkv"].take(grouped_channels(cfg), 1)
    return gdn


def _load_layer(cfg: ModelConfig, src: _Source, p: str, mixer: str, mlp: str) -> dict:
    layer = _load_spec(src, _layer_norms(cfg, p))
    if mixer == FULL:
        layer["attn"] = _load_spec(src, _attn_spec(cfg, p))
    else:
        layer["gdn"] = _load_gdn(cfg, src, p)
    if mlp == "moe":
        layer["moe"] = _load_moe(cfg, src, p)
    else:
        layer["mlp"] = _load_spec(src, _dense_mlp_spec(cfg, p, cfg.intermediate_size))
    return layer


def _mtp_mlp_kind(cfg: ModelConfig) -> str:
    return "moe" if cfg.num_experts > 0 else "dense"


def _mtp_layer_count(src: _Source) -> int:
    n = 0
    while f"mtp.layers.{n}.input_layernorm.weight" in src:
        n += 1
    return n


def _load_mtp(cfg: ModelConfig, src: _Source) -> dict[str, Any]:
    mtp = _load_spec(src, _mtp_spec(cfg))
    mtp["layers"] = [_load_layer(cfg, src, f"mtp.layers.{i}.", FULL, _mtp_mlp_kind(cfg))
                     for i in range(_mtp_layer_count(src))]
    if not mtp["layers"]:
        raise CheckpointError("checkpoint has mtp.fc.weight but no mtp.layers.0.* decoder layer")
    return mtp


def _materialize(t: _Lazy, sharding, dtype) -> jax.Array:
    """One weight on the device(s): whole, or (a sharding) each device's shard read on its own, so
    no device ever holds the whole weight first. A shard shared by several devices is read once."""
    if sharding is None:  # device_put, not jnp.asarray: that stages a copy executable per shape (a compile)
        return jax.device_put(np.asarray(t.full(), dtype=dtype))
    read: dict[tuple, np.ndarray] = {}

    def shard(index):
        key = tuple((s.start, s.stop) for s in _norm_index(index, t.shape))
        if key not in read:
            read[key] = np.asarray(t[index], dtype=dtype)
        return read[key]

    return jax.make_array_from_callback(t.shape, sharding, shard)


def resolve_dtype(cfg: ModelConfig, dtype: str) -> jnp.dtype:
    """"auto" -> cfg.torch_dtype; "bfloat16" / "float32" as named."""
    if dtype not in VALID_DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; valid: {', '.join(VALID_DTYPES)}")
    name = cfg.torch_dtype if dtype == "auto" else dtype
    if name not in ("bfloat16", "float32"):
        raise ValueError(f"config torch_dtype={name!r} (dtype='auto') is not supported; "
                         f"pass dtype='bfloat16' or 'float32'")
    return jnp.dtype(name)


def hf_to_params(cfg: ModelConfig, tensors, dtype: str = "auto") -> dict[str, Any]:
    """HF tensors {name: [out, in] ...} (numpy arrays or open_checkpoint's views) -> params
    pytree of docs/architecture.md (jax arrays of `dtype`: "auto" = cfg.torch_dtype, "bfloat16" or
    "float32"), each sharded over cfg.mesh by jaxspec.sharding and read shard by shard.
    `model.visual.*` tensors are skipped; `mtp.*` tensors land in params["mtp"] when present.
    Raises CheckpointError naming a missing tensor or a tensor whose shape does not match the config."""
    from jaxspec import sharding

    target = resolve_dtype(cfg, dtype)
    src = _Source(tensors)
    tree = _load_spec(src, _top_spec(cfg))
    tree["layers"] = [_load_layer(cfg, src, _layer_prefix(cfg, i), cfg.layer_types[i], cfg.mlp_kinds[i])
                      for i in range(cfg.num_hidden_layers)]
    if "mtp.fc.weight" in src:
        tree["mtp"] = _load_mtp(cfg, src)
    elif cfg.mtp_num_hidden_layers:
        log.info("config has mtp_num_hidden_layers=%d but the checkpoint has no mtp.* weights",
                 cfg.mtp_num_hidden_layers)
    _report_unused(src)
    return materialize(tree, sharding.param_shardings(cfg, tree), target)


def lazy(tree) -> Any:
    """A tree of stored tensors (numpy arrays, open_checkpoint's views) -> the same tree of lazy
    tensors, each with .shape and read on demand, shard by shard."""
    return jax.tree_util.tree_map(_Lazy.of, tree)


def materialize(tree, shardings, dtype) -> Any:
    """A tree of lazy tensors (or anything `lazy` takes) -> the same tree of jax arrays of `dtype`
    placed by `shardings` (a matching tree; None leaves = the default device, uncommitted like
    every other load path's arrays). READ_THREADS tensors are read at once, so the file reads of
    some overlap the host-to-device copies of others."""
    leaves, treedef = jax.tree_util.tree_flatten(lazy(tree))
    shards = jax.tree_util.tree_leaves(shardings, is_leaf=lambda x: x is None)
    total = sum(int(np.prod(t.shape)) for t in leaves) * np.dtype(dtype).itemsize
    with ThreadPoolExecutor(READ_THREADS) as pool:
        futures = [pool.submit(_materialize, t, sh, dtype) for t, sh in zip(leaves, shards, strict=True)]
        arrays = [f.result() for f in tqdm(futures, desc="loading weights", unit="tensor",
                                           disable=total <= PROGRESS_BYTES)]
    return jax.block_until_ready(jax.tree_util.tree_unflatten(treedef, arrays))


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


def _ungroup(cfg: ModelConfig, a) -> np.ndarray:
    """Columns in the grouped GDN channel layout -> the flat [q | k | v] order."""
    a = np.asarray(a)
    flat = np.empty_like(a)
    flat[:, grouped_channels(cfg)] = a
    return flat


def _export_layer(cfg: ModelConfig, layer: dict, p: str, out: Tensors, fused_experts: bool) -> None:
    _export_spec(layer, _layer_norms(cfg, p), out)
    if "attn" in layer:
        _export_spec(packing.unpack_attention(layer["attn"], cfg), _attn_spec(cfg, p), out)
    else:
        gdn = dict(packing.unpack_gdn(layer["gdn"], cfg))
        gdn["conv"] = _ungroup(cfg, gdn["conv"])
        _export_spec(gdn, _gdn_common_spec(cfg, p), out)
        if cfg.family == "qwen3_next":
            names = _next_grouped_names(cfg, p)
            for name, keys in (("qkvz", ("qkv", "z")), ("ba", ("b", "a"))):
                rows = _next_rows(cfg)
                t = np.empty(names[name][1], np.asarray(gdn["qkv"]).dtype)
                for key in keys:
                    t[rows[key]] = np.asarray(gdn[key]).T
                out[names[name][0]] = t
        else:
            _export_spec(dict(gdn, qkv=_ungroup(cfg, gdn["qkv"])), _gdn_flat_spec(cfg, p), out)
    if "moe" in layer:
        moe = layer["moe"]
        _export_spec(moe, _moe_spec(cfg, p), out)
        _export_experts(moe, p, out, fused_experts)
        if "shared" in moe:
            spec = _dense_mlp_spec(cfg, p, cfg.shared_expert_intermediate_size, name="mlp.shared_expert")
            _export_spec(packing.unpack_mlp(moe["shared"]), spec, out)
    else:
        _export_spec(packing.unpack_mlp(layer["mlp"]), _dense_mlp_spec(cfg, p, cfg.intermediate_size), out)


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
