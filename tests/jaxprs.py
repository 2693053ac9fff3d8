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


def primitive_count(jaxpr, name: str) -> int:
    """Equations of primitive `name` in jaxpr (a Jaxpr or ClosedJaxpr) and all its sub-jaxprs."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name == name
        for param in eqn.params.values():
            count += sum(primitive_count(sub, name) for sub in _subjaxprs(param))
    return count


def pallas_calls(fn, *args) -> int:
    """pallas_call equations in jax.make_jaxpr(fn)(*args) (tracing only, nothing runs)."""
    return primitive_count(jax.make_jaxpr(fn)(*args), "pallas_call")
