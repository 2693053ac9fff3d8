"""Compilation accounting through jax.monitoring (public API only).

`count_compiles()` counts, while active, the jaxpr traces, the XLA backend compiles (each event is a
compile or a persistent-cache load) and the persistent-cache hits. Steady-state serving must show
zero backend compiles and zero traces.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import jax.monitoring as monitoring

_TRACE = "/jax/core/compile/jaxpr_trace_duration"
_BACKEND = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"


@dataclass
class CompileCount:
    traces: int = 0
    backend_compiles: int = 0  # XLA compiles plus persistent-cache loads
    cache_hits: int = 0
    compile_seconds: float = 0.0

    @property
    def compiles(self) -> int:
        """Compilations not served by the persistent cache."""
        return self.backend_compiles - self.cache_hits


_active: list[CompileCount] = []
_registered = False


def _on_duration(name: str, seconds: float, **_) -> None:
    for count in _active:
        if name == _TRACE:
            count.traces += 1
        elif name == _BACKEND:
            count.backend_compiles += 1
            count.compile_seconds += seconds


def _on_event(name: str, **_) -> None:
    if name == _CACHE_HIT:
        for count in _active:
            count.cache_hits += 1


def _register() -> None:
    global _registered
    if not _registered:  # listeners cannot be removed one by one on every jax version; register once
        monitoring.register_event_duration_secs_listener(_on_duration)
        monitoring.register_event_listener(_on_event)
        _registered = True


@contextlib.contextmanager
def count_compiles():
    """with count_compiles() as c: ...; then c.traces, c.backend_compiles, c.cache_hits."""
    _register()
    count = CompileCount()
    _active.append(count)
    try:
        yield count
    finally:
        _active.remove(count)
