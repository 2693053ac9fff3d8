"""The params of a `jaxspec.save` directory: one safetensors file in the engine's own layout and
dtype (docs/architecture.md, "Parameters"), so loading it is a plain read: no transposes, no
reorders, no casts unless a different dtype is asked for.

`params.safetensors` holds one tensor per params leaf, named by its tree path ("embed",
"layers.3.attn.q", "mtp.layers.0.mlp.down"). Loading reads it through the same memory-mapped reader as a
Hugging Face checkpoint (weights.materialize): several tensors at once, each device reading only
its own shard, so a saved model restores into the shards of any mesh.

The other format, `format="orbax"`, is an orbax checkpoint in `params/` (StandardCheckpointer):
every process writes and reads only its own shards, so it is the one to use when the model is
saved from several processes (jaxspec.initialize_distributed); it restores into any mesh too.
Single-process saves default to safetensors, which loads faster (docs/benchmarks.md, "Compile and
start-up").
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxspec import weights

PARAMS_FILE = "params.safetensors"
ORBAX_SUBDIR = "params"  # the orbax checkpoint of format="orbax"
FORMATS = ("safetensors", "orbax")


def leaf_name(path) -> str:
    """The name of the params leaf at a tree path: dict keys and list indices joined by dots
    ("layers.3.attn.q")."""
    return ".".join(str(k.key if isinstance(k, jax.tree_util.DictKey) else k.idx) for k in path)


def default_format() -> str:
    """safetensors in one process; orbax when several processes hold the model's shards."""
    return "orbax" if jax.process_count() > 1 else "safetensors"


def resolve_format(format: str | None) -> str:
    """format, or default_format() for None; a ValueError naming the choices for anything else."""
    format = format or default_format()
    if format not in FORMATS:
        raise ValueError(f"format={format!r} is not a params format; choose one of {FORMATS}")
    return format


def save_params(params: dict[str, Any], directory: str | os.PathLike, format: str | None = None) -> Path:
    """Writes params to directory in `format` (FORMATS; None: default_format()), overwrite-safe
    (the new files are written beside the old ones, then renamed over them); the other format's
    files of an earlier save are removed. Returns the params path."""
    format = resolve_format(format)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if format == "orbax":
        path = _save_orbax(params, directory)
        (directory / PARAMS_FILE).unlink(missing_ok=True)
        return path
    if jax.process_count() > 1:
        raise ValueError(f"format='safetensors' writes whole arrays from one process, but "
                         f"{jax.process_count()} processes hold this model's shards: save with format='orbax'")
    flat = {leaf_name(path): np.asarray(x) for path, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    path = weights.write_safetensors(flat, directory / PARAMS_FILE)
    shutil.rmtree(directory / ORBAX_SUBDIR, ignore_errors=True)
    return path


def _save_orbax(params: dict[str, Any], directory: Path) -> Path:
    import orbax.checkpoint as ocp

    directory = directory.absolute()
    final, tmp, old = (directory / ORBAX_SUBDIR, directory / (ORBAX_SUBDIR + ".saving"),
                       directory / (ORBAX_SUBDIR + ".old"))
    for stale in (tmp, old):
        shutil.rmtree(stale, ignore_errors=True)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(tmp, params)
        ckptr.wait_until_finished()
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def _unflatten(flat: dict[str, Any]) -> dict[str, Any]:
    """{"layers.0.attn.q": x, ...} -> the nested params tree; a dict whose keys are all indices is a
    list (the layers)."""
    root: dict = {}
    for name, value in flat.items():
        *parents, leaf = name.split(".")
        node = root
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value

    def lists(node):
        if not isinstance(node, dict):
            return node
        if node and all(k.isdigit() for k in node):
            return [lists(node[str(i)]) for i in range(len(node))]
        return {k: lists(v) for k, v in node.items()}

    return lists(root)


def open_params(directory: str | os.PathLike) -> dict[str, Any]:
    """The saved params tree as lazy tensors (nothing read yet; each has .shape); CheckpointError
    when the directory has no params.safetensors."""
    path = Path(directory) / PARAMS_FILE
    if not path.is_file():
        raise weights.CheckpointError(f"no saved params at {str(path)!r} (written by jaxspec.save)")
    return weights.lazy(_unflatten(weights.open_checkpoint(path)))


def restore_params(directory: str | os.PathLike, dtype, shardings_of=None) -> dict[str, Any]:
    """The params saved in directory as jax arrays of `dtype`, each leaf read straight into its
    shards: shardings_of(tree of lazy tensors with .shape) -> the matching tree of shardings (None,
    or None leaves: the default device)."""
    lazy = open_params(directory)
    shardings = shardings_of(lazy) if shardings_of else jax.tree_util.tree_map(lambda _: None, lazy)
    return weights.materialize(lazy, shardings, dtype)


def has_orbax_params(directory: str | os.PathLike) -> bool:
    return (Path(directory) / ORBAX_SUBDIR).is_dir()


def restore_orbax(directory: str | os.PathLike, shardings_of, dtype) -> dict[str, Any]:
    """An orbax `params/` checkpoint (format="orbax", and every directory saved by earlier
    versions) in `dtype`: into the shardings of a mesh when shardings_of gives any, else read as
    host arrays and copied to the default device once (uncommitted, like every other load path:
    jit keys committed arrays apart, so a reloaded model would recompile)."""
    import orbax.checkpoint as ocp

    path = (Path(directory) / ORBAX_SUBDIR).absolute()
    with ocp.PyTreeCheckpointer() as ckptr:
        meta = ckptr.metadata(path)
        shapes = getattr(getattr(meta, "item_metadata", meta), "tree", getattr(meta, "tree", meta))
        shardings = shardings_of(shapes)

        def args(m, sharding):
            if sharding is None:
                return ocp.RestoreArgs(restore_type=np.ndarray, dtype=dtype)
            return ocp.ArrayRestoreArgs(sharding=sharding, dtype=dtype, global_shape=tuple(m.shape))

        restore_args = jax.tree_util.tree_map(args, shapes, shardings, is_leaf=lambda x: x is None)
        params = ckptr.restore(path, restore_args=restore_args)
    return params if jax.tree_util.tree_leaves(shardings) else jax.device_put(params)
