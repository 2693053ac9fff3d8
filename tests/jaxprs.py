"""Which primitives a traced function runs: a recursive search of its jaxpr (sub-jaxprs of jit,
scan, cond, custom_vjp ... included), used to prove that kernels="pallas" reaches the Pallas
kernels and kernels="xla" does not."""

from __future__ import annotations

from collections.abc import Iterator

import jax


def _subjaxprs(value) -> Iterator:
    if hasattr(value, "eqns"):  # a Jaxpr
        yield value
    elif hasattr(value, "jaxpr") and hasattr(value.jaxpr, "eqns"):  # a ClosedJaxpr
        yield value.jaxpr
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _subjaxprs(v)


def _kernel_name(eqn) -> str | None:
    """A pallas_call's kernel name (its `name` param, or `name_and_src_info.name` in other jax versions)."""
    info = eqn.params.get("name_and_src_info")
    return getattr(info, "name", None) or eqn.params.get("name")


def primitive_count(jaxpr, name: str, kernel: str | None = None) -> int:
    """Equations of primitive `name` in jaxpr (a Jaxpr or ClosedJaxpr) and all its sub-jaxprs; with
    `kernel`, only the pallas_calls of that kernel name."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name == name and (kernel is None or _kernel_name(eqn) == kernel)
        for param in eqn.params.values():
            count += sum(primitive_count(sub, name, kernel) for sub in _subjaxprs(param))
    return count


def pallas_calls(fn, *args, kernel: str | None = None) -> int:
    """pallas_call equations (of the kernel named `kernel`, if given) in jax.make_jaxpr(fn)(*args)
    (tracing only, nothing runs)."""
    return primitive_count(jax.make_jaxpr(fn)(*args), "pallas_call", kernel)
