"""Tensor parallelism over a `jax.sharding.Mesh` (docs/architecture.md, "Tensor parallelism").

One mesh axis, "tp". Every params leaf and cache carries logical axis names (heads, kv_heads, mlp,
vocab, gdn_heads, experts, expert_mlp, cache_heads); flax's logical partitioning rules map them to
the mesh axis, and GSPMD partitions the jitted executables from the shardings of their arguments.
The kernels (paged attention, GDN recurrence, conv) run per device inside `jax.shard_map`, on the
heads of their shard. A model without a mesh (tensor_parallel_size 1) runs exactly as before:
nothing here is called with a mesh of None except the no-op paths.
"""

from __future__ import annotations

import re

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

AXIS = "tp"

# Logical axes of each params leaf, by (parent key, leaf key); leaves not listed are replicated.
# Column-parallel projections split their output, row-parallel ones their input (one all-reduce
# after o / down / out). MoE experts are split along their intermediate dimension (expert_mlp),
# not by expert: see docs/architecture.md, "Tensor parallelism", for the measurement.
_PARAM_AXES = {
    ("", "embed"): ("vocab", None), ("", "lm_head"): (None, "vocab"),
    ("attn", "q"): (None, "heads"), ("attn", "k"): (None, "kv_heads"), ("attn", "v"): (None, "kv_heads"),
    ("attn", "o"): ("heads", None), ("attn", "q_bias"): ("heads",), ("attn", "k_bias"): ("kv_heads",),
    ("attn", "v_bias"): ("kv_heads",),
    ("gdn", "qkv"): (None, "gdn_heads"), ("gdn", "z"): (None, "gdn_heads"), ("gdn", "b"): (None, "gdn_heads"),
    ("gdn", "a"): (None, "gdn_heads"), ("gdn", "conv"): (None, "gdn_heads"), ("gdn", "A_log"): ("gdn_heads",),
    ("gdn", "dt_bias"): ("gdn_heads",), ("gdn", "out"): ("gdn_heads", None),
    ("mlp", "gate"): (None, "mlp"), ("mlp", "up"): (None, "mlp"), ("mlp", "down"): ("mlp", None),
    ("shared", "gate"): (None, "mlp"), ("shared", "up"): (None, "mlp"), ("shared", "down"): ("mlp", None),
    ("moe", "gate"): ("experts", None, "expert_mlp"), ("moe", "up"): ("experts", None, "expert_mlp"),
    ("moe", "down"): ("experts", "expert_mlp", None),
}
# Caches: KV pages [pages, page, heads, D], GDN state [slots, HV, dk, dv], conv lines [lines, L, C].
KV_AXES = (None, None, "cache_heads", None)
SSM_AXES = (None, "gdn_heads", None, None)
CONV_AXES = (None, None, "gdn_heads")


def tp_size(cfg) -> int:
    return 1 if cfg.mesh is None else cfg.mesh.shape[AXIS]


def rules(cfg) -> tuple[tuple[str, str | None], ...]:
    """Logical axis -> mesh axis (flax.linen logical axis rules). KV heads fewer than the devices
    stay whole in the weights (replicated); the KV cache then holds one repeated head per device."""
    kv = AXIS if cfg.num_key_value_heads % tp_size(cfg) == 0 else None
    return (("vocab", AXIS), ("heads", AXIS), ("kv_heads", kv), ("cache_heads", AXIS), ("mlp", AXIS),
            ("gdn_heads", AXIS), ("experts", None), ("expert_mlp", AXIS))


def kv_cache_heads(cfg) -> int:
    """KV heads in the cache: the model's, or one per device when there are fewer (each device's q
    heads read the kv head they belong to; docs/architecture.md, "Tensor parallelism")."""
    n = tp_size(cfg)
    return cfg.num_key_value_heads if cfg.num_key_value_heads % n == 0 else n


def _must_divide(cfg) -> dict[str, int]:
    """The sizes a tensor-parallel size must divide (split contiguously over the devices)."""
    sizes = {"num_attention_heads": cfg.num_attention_heads, "vocab_size": cfg.vocab_size}
    if "dense" in cfg.mlp_kinds:
        sizes["intermediate_size"] = cfg.intermediate_size
    if "moe" in cfg.mlp_kinds:
        sizes["moe_intermediate_size"] = cfg.moe_intermediate_size
        if cfg.shared_expert_intermediate_size:
            sizes["shared_expert_intermediate_size"] = cfg.shared_expert_intermediate_size
    if cfg.is_hybrid:
        sizes["linear_num_key_heads"] = cfg.linear_num_key_heads  # whole key-head (GVA) groups per device
    return sizes


def _problem(cfg, n: int) -> str | None:
    for name, size in _must_divide(cfg).items():
        if size % n:
            return f"tensor_parallel_size={n} does not divide {name}={size}"
    kv = cfg.num_key_value_heads
    if kv % n and n % kv:
        return f"tensor_parallel_size={n} and num_key_value_heads={kv}: one must divide the other"
    return None


def valid_sizes(cfg, limit: int = 64) -> list[int]:
    """The tensor-parallel sizes up to `limit` that the model's dimensions allow (devices aside)."""
    return [n for n in range(1, limit + 1) if _problem(cfg, n) is None]


def check(cfg, n) -> None:
    """Refuse, naming the numbers, a tensor_parallel_size that the devices or the model cannot take."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"tensor_parallel_size={n!r} must be a positive integer")
    devices = jax.device_count()
    if n > devices:
        raise ValueError(f"tensor_parallel_size={n} exceeds the {devices} {jax.default_backend()} device(s) "
                         f"present; choose at most {devices}")
    problem = _problem(cfg, n)
    if problem:
        raise ValueError(f"{problem}; sizes this model allows: {', '.join(map(str, valid_sizes(cfg)))}")


def make_mesh(n: int) -> Mesh | None:
    """A one-axis mesh over the first n devices (all processes'), or None for n = 1."""
    return None if n == 1 else Mesh(np.array(jax.devices()[:n]), (AXIS,))


def _spec(cfg, axes) -> P:
    import flax.linen as nn

    return nn.logical_to_mesh_axes(axes, rules(cfg))


def named(cfg, axes) -> NamedSharding | None:
    """The sharding of an array with these logical axes (None without a mesh)."""
    return None if cfg.mesh is None else NamedSharding(cfg.mesh, _spec(cfg, axes))


def param_axes(path, ndim: int) -> tuple:
    """Logical axes of the params leaf at a tree path (docs/architecture.md, "Parameters")."""
    keys = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
    parent = keys[-2] if len(keys) > 1 else ""
    axes = _PARAM_AXES.get((parent, keys[-1]), (None,) * ndim)
    return axes if len(axes) == ndim else (None,) * ndim


def param_shardings(cfg, params):
    """A tree of NamedSharding matching params (arrays, shapes or lazy tensors with .shape); None
    leaves without a mesh."""
    return jax.tree_util.tree_map_with_path(lambda path, x: named(cfg, param_axes(path, len(x.shape))), params)


def replicated(mesh: Mesh | None) -> NamedSharding | None:
    return None if mesh is None else NamedSharding(mesh, P())


def put(tree, mesh: Mesh | None):
    """Host values -> device arrays: replicated over the mesh, or (no mesh) jax.device_put as before."""
    return jax.device_put(tree) if mesh is None else jax.device_put(tree, replicated(mesh))


def mesh_of(tree) -> Mesh | None:
    """The mesh the first leaf of tree is placed on, or None."""
    for leaf in jax.tree_util.tree_leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        return sharding.mesh if isinstance(sharding, NamedSharding) else None
    return None


def abstract(tree, mesh: Mesh | None):
    """Shapes for AOT lowering with the shardings the runtime arrays have: an array keeps its own,
    a bare ShapeDtypeStruct becomes replicated over the mesh (what `put` gives at run time)."""
    if mesh is None:
        return tree

    def one(x):
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        if isinstance(x, jax.ShapeDtypeStruct) and x.sharding is None:
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated(mesh))
        return x

    return jax.tree_util.tree_map(one, tree)


def constrain(x, cfg, axes):
    """with_sharding_constraint to the logical axes (identity without a mesh)."""
    return x if cfg.mesh is None else jax.lax.with_sharding_constraint(x, named(cfg, axes))


def local(fn, cfg, in_axes: tuple, out_axes, *, reduce: bool = False):
    """fn run per device on its shard (jax.shard_map) where the model has a mesh, else fn itself.
    in_axes / out_axes: logical axes per argument / output (None = replicated, every device runs
    the same values). reduce: each device's output is a partial sum (fn contracted a sharded
    axis); they are summed over the devices (one all-reduce) into out_axes."""
    if cfg.mesh is None:
        return fn
    if reduce:
        fn = _summed(fn)

    def spec(axes):
        return P() if axes is None else _spec(cfg, axes)

    def specs(tree):
        return tuple(specs(t) for t in tree) if isinstance(tree, list) else spec(tree)

    outs = specs(out_axes) if isinstance(out_axes, list) else spec(out_axes)
    return jax.shard_map(fn, mesh=cfg.mesh, in_specs=tuple(spec(a) for a in in_axes), out_specs=outs,
                         check_vma=False)


def _summed(fn):
    def run(*args):
        return jax.tree_util.tree_map(lambda y: jax.lax.psum(y, AXIS), fn(*args))
    return run


def shard_bytes(x) -> int:
    """Bytes one device holds of an array or a ShapeDtypeStruct (its shard; the whole without one)."""
    shape = x.shape
    sharding = getattr(x, "sharding", None)
    if sharding is not None and hasattr(sharding, "shard_shape"):
        shape = sharding.shard_shape(shape)
    return int(np.prod(shape)) * np.dtype(x.dtype).itemsize


COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def count_collectives(hlo_text: str) -> dict[str, int]:
    """Collective ops in compiled HLO text ({op: count}; async pairs count once, at their start)."""
    counts = {}
    for op in COLLECTIVES:
        n = len(re.findall(rf"= [^=\n]*\b{op}(?:-start)?\(", hlo_text))
        if n:
            counts[op] = n
    return counts


def initialize_distributed(coordinator_address: str, num_processes: int, process_id: int, **kwargs) -> None:
    """Join a multi-process run (one process per host or per GPU) before anything touches a device:
    jax.distributed.initialize; afterwards jax.devices() lists every process's devices, and a mesh
    over them spans the hosts (docs/user_guide.md, "Several GPUs and several hosts")."""
    if not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"num_processes={num_processes!r} must be a positive integer")
    if not isinstance(process_id, int) or not 0 <= process_id < num_processes:
        raise ValueError(f"process_id={process_id!r} must be an integer in [0, num_processes={num_processes})")
    jax.distributed.initialize(coordinator_address, num_processes, process_id, **kwargs)
