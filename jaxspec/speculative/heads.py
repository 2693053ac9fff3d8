"""What the tap drafters (speculative/eagle3.py, speculative/dflash.py) share: the `Head` record of a
loaded drafter checkpoint, the draft layers' ModelConfig from its config.json, host-side tensor
loading by explicit HF names, device copies per dtype, and the resolution of `draft_model=` (a
checkpoint directory, a loaded head, or a demo name) (docs/speculation.md#eagle-3, #dflash).

Params stay on the host (numpy) in the head; each target dtype gets one device copy, made by a
host cast and a transfer (no device compile), so a generate call after precompile compiles nothing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import jax
import numpy as np

from jaxspec.config import FULL, ConfigError, ModelConfig, _rope
from jaxspec.weights import CheckpointError, _Source, _take, read_checkpoint_tensors


@dataclass(eq=False)
class Head:
    """A loaded tap drafter: its frozen config (eagle3.Eagle3Config or dflash.DFlashConfig, a jit
    key) and host params (numpy, the layout of docs/architecture.md#tap-drafters)."""

    method: str  # "eagle3" | "dflash"
    config: object
    params: dict
    source: str = ""  # where it was loaded from (for messages)
    _device: dict = field(default_factory=dict, repr=False)

    def device_params(self, dtype, abstract: bool = False) -> dict:
        """The params as device arrays of dtype (float leaves; integer maps stay int32), made once;
        abstract: their ShapeDtypeStructs (for precompile)."""
        def kind(x):
            return np.int32 if x.dtype.kind in "iub" else dtype

        if abstract:
            return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, kind(x)), self.params)
        key = np.dtype(dtype).name
        if key not in self._device:
            self._device[key] = jax.device_put(jax.tree_util.tree_map(lambda x: x.astype(kind(x)), self.params))
        return self._device[key]

    def nbytes(self, dtype) -> int:
        """Bytes of device_params(dtype)."""
        size = np.dtype(dtype).itemsize
        return sum(x.size * (4 if x.dtype.kind in "iub" else size) for x in jax.tree_util.tree_leaves(self.params))


def check_sizes(head: Head, target: ModelConfig, what: str) -> None:
    """Refuse a drafter whose hidden size or vocabulary is not the target's (names the field)."""
    for name in ("hidden_size", "vocab_size"):
        mine, theirs = getattr(head.config.layer, name), getattr(target, name)
        if mine != theirs:
            raise ValueError(f"{what} {head.source}: {name}={mine} differs from the target's {name}={theirs}; "
                             f"the drafter must be trained for this target")


def open_checkpoint(path, parse) -> tuple[dict, object, _Source]:
    """(config.json dict, parse(that dict), the tensors) of a drafter checkpoint directory."""
    from jaxspec.loader import _read_config

    d = _read_config(Path(path))
    return d, parse(d), _Source(read_checkpoint_tensors(path))


def finish(method: str, cfg, params: dict, src: _Source, path, d: dict, dtype: str) -> Head:
    """The Head, once every tensor of the checkpoint was used; float params in the host dtype."""
    check_unused(src, path)
    host = float_dtype(d, dtype)
    params = jax.tree_util.tree_map(lambda x: x if x.dtype.kind in "iub" else x.astype(host), params)
    return Head(method, cfg, params, source=str(path))


def _positive(d: dict, name: str, default=None) -> int:
    value = d.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"drafter config {name}={value!r} must be a positive integer")
    return value


def layer_config(d: dict) -> ModelConfig:
    """The ModelConfig of a drafter's decoder layers (full attention, dense SwiGLU MLP, plain
    RMSNorm w * x, full RoPE) from its config.json; the vocabulary is the target's (vocab_size)."""
    hidden, heads = _positive(d, "hidden_size"), _positive(d, "num_attention_heads")
    if d.get("attention_bias"):
        raise ConfigError("drafter config attention_bias=true is not supported (valid: false)")
    if d.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"drafter config hidden_act={d['hidden_act']!r} is not supported (valid: 'silu')")
    theta, factor = _rope(d)
    n = _positive(d, "num_hidden_layers")
    return ModelConfig(model_type="qwen3", vocab_size=_positive(d, "vocab_size"), hidden_size=hidden,
                       num_hidden_layers=n, num_attention_heads=heads,
                       num_key_value_heads=_positive(d, "num_key_value_heads", heads),
                       head_dim=_positive({"head_dim": d.get("head_dim") or hidden // heads}, "head_dim"),
                       intermediate_size=_positive(d, "intermediate_size"),
                       rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)), rope_theta=theta,
                       partial_rotary_factor=factor,
                       max_position_embeddings=_positive(d, "max_position_embeddings", 32768),
                       layer_types=(FULL,) * n, mlp_kinds=("dense",) * n)


def layer_spec(cfg: ModelConfig, p: str, q_in: int, qk_norm: bool) -> dict:
    """{params path: (HF name, HF shape)} of one draft decoder layer under prefix p; q_in is the
    attention's input width (2H for EAGLE-3's [embedding, hidden] input)."""
    H, D, nH, nKV, inner = (cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads,
                            cfg.intermediate_size)
    spec = {("input_norm",): (p + "input_layernorm.weight", (H,)),
            ("post_norm",): (p + "post_attention_layernorm.weight", (H,)),
            ("attn", "q"): (p + "self_attn.q_proj.weight", (nH * D, q_in)),
            ("attn", "k"): (p + "self_attn.k_proj.weight", (nKV * D, q_in)),
            ("attn", "v"): (p + "self_attn.v_proj.weight", (nKV * D, q_in)),
            ("attn", "o"): (p + "self_attn.o_proj.weight", (H, nH * D)),
            ("mlp", "gate"): (p + "mlp.gate_proj.weight", (inner, H)),
            ("mlp", "up"): (p + "mlp.up_proj.weight", (inner, H)),
            ("mlp", "down"): (p + "mlp.down_proj.weight", (H, inner))}
    if qk_norm:
        spec[("attn", "q_norm")] = (p + "self_attn.q_norm.weight", (D,))
        spec[("attn", "k_norm")] = (p + "self_attn.k_norm.weight", (D,))
    return spec


def load_spec(src: _Source, spec: dict) -> dict:
    """Host params from {path: (HF name, HF shape)}: 2-d weights are HF [out, in], stored [in, out]."""
    out: dict = {}
    for path, (name, shape) in spec.items():
        t = _take(src, name, shape).full()
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = np.ascontiguousarray(t.T if t.ndim == 2 else t)
    return out


def check_unused(src: _Source, path: Path) -> None:
    unused = sorted(set(src.tensors) - src.used)
    if unused:
        raise CheckpointError(f"{path}: tensors this drafter layout does not use, e.g. {', '.join(unused[:4])}; "
                              f"is it a checkpoint of another method or variant?")


def float_dtype(d: dict, dtype: str):
    """The host dtype of a head's float params: "auto" = config torch_dtype (else float32)."""
    import ml_dtypes

    name = (d.get("torch_dtype") or d.get("dtype") or "float32") if dtype == "auto" else dtype
    valid = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float32}
    if name not in valid:
        raise ValueError(f"dtype={name!r} is not valid for a drafter; choose 'auto', 'float32' or 'bfloat16'")
    return valid[name]


DEMO_HEADS = {"demo-eagle3": "eagle3", "demo-dflash": "dflash"}  # shipped drafters of the demo target


def resolve(method: str, draft_model, loader) -> Head:
    """draft_model= of an eagle3 / dflash SpeculativeConfig -> a Head: a loaded head is kept, a demo
    name or a checkpoint directory is loaded with loader(path)."""
    what = {"eagle3": "an EAGLE-3", "dflash": "a DFlash"}[method]
    usage = (f"method={method!r} needs draft_model= {what} checkpoint directory, a head loaded with "
             f"jaxspec.speculative.{method}.load(path), or 'demo-{method}'")
    if isinstance(draft_model, Head):
        if draft_model.method != method:
            raise ValueError(f"draft_model is a {draft_model.method} head ({draft_model.source}); {usage}")
        return draft_model
    if not isinstance(draft_model, str | os.PathLike):
        raise ValueError(f"draft_model={draft_model!r}: {usage}")
    name = str(draft_model)
    if name in DEMO_HEADS:
        from jaxspec import demo

        if DEMO_HEADS[name] != method:
            raise ValueError(f"draft_model={name!r} is the {DEMO_HEADS[name]} demo drafter; {usage}")
        return loader(demo.trained_head_dir(name))
    path = Path(draft_model)
    if not path.is_dir():
        raise FileNotFoundError(f"draft_model={name!r} does not exist or is not a directory; {usage}")
    return loader(path)


# ---- writing (the inverse of loading) ------------------------------------------------------------------

def layer_config_json(cfg: ModelConfig) -> dict:
    """config.json fields of the draft layers (read back by layer_config)."""
    d = {"hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_hidden_layers,
         "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
         "head_dim": cfg.head_dim, "intermediate_size": cfg.intermediate_size, "rms_norm_eps": cfg.rms_norm_eps,
         "rope_theta": cfg.rope_theta, "vocab_size": cfg.vocab_size, "hidden_act": "silu", "attention_bias": False,
         "max_position_embeddings": cfg.max_position_embeddings, "tie_word_embeddings": False}
    if cfg.partial_rotary_factor != 1.0:
        d["partial_rotary_factor"] = cfg.partial_rotary_factor
    return d


def storage_dtype(params: dict, dtype: str | None) -> tuple[str, object]:
    """(torch_dtype name, numpy dtype) to store the float params in: dtype ("float32" / "bfloat16"),
    or None for the params' own float dtype (one for all leaves, so loading gives them back exactly)."""
    import ml_dtypes

    valid = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
    if dtype is None:
        leaves = [np.asarray(x) for x in jax.tree_util.tree_leaves(params)]
        kinds = {x.dtype for x in leaves if x.dtype.kind not in "iub"}
        names = [n for n, d in valid.items() if d in kinds]
        if len(kinds) != 1 or not names:
            raise ValueError(f"params have float dtypes {sorted(map(str, kinds))}; pass dtype='float32' or 'bfloat16'")
        dtype = names[0]
    if dtype not in valid:
        raise ValueError(f"dtype={dtype!r} is not valid for a drafter checkpoint; choose 'float32' or 'bfloat16'")
    return dtype, valid[dtype]


def export_spec(params: dict, spec: dict, dtype) -> dict:
    """{HF name: array} of params by a load_spec spec: 2-d weights back to HF [out, in], floats as dtype."""
    out = {}
    for path, (name, shape) in spec.items():
        node = params
        for key in path:
            node = node[key]
        t = np.asarray(node).astype(dtype)
        t = np.ascontiguousarray(t.T if t.ndim == 2 else t)
        if t.shape != tuple(shape):
            raise ValueError(f"params{list(path)} exports to {name!r} with shape {list(t.shape)}, "
                             f"expected {list(shape)}")
        out[name] = t
    return out


def write_checkpoint(directory, config: dict, tensors: dict) -> Path:
    """config.json and model.safetensors of a drafter checkpoint in `directory` (created)."""
    import json

    from jaxspec.weights import SINGLE_FILE, write_safetensors

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_safetensors(tensors, directory / SINGLE_FILE)
    return directory
