"""Executable caching: compile accounting, the persistent XLA compilation cache, the bucket table
and ahead-of-time precompilation.

`count_compiles()` counts, while active, the jaxpr traces, the XLA backend compiles (each event is a
compile or a persistent-cache load) and the persistent-cache hits and misses (jax.monitoring, public
API only). Steady-state serving must show zero backend compiles and zero traces.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import jax.monitoring as monitoring

from jaxspec import sharding
from jaxspec.config import prefill_row_buckets
from jaxspec.speculative.dynamic import k_buckets
from jaxspec.speculative.session import SESSIONS

_TRACE = "/jax/core/compile/jaxpr_trace_duration"
_BACKEND = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_CACHE_MISS = "/jax/compilation_cache/cache_misses"


# A jit call that misses the C++ dispatch cache but hits Python's trace cache still reports a
# trace event, of some microseconds; tracing one of the engine's functions takes milliseconds.
REAL_TRACE_S = 1e-3


@dataclass
class CompileCount:
    traces: int = 0
    real_traces: int = 0  # traces that took >= REAL_TRACE_S: a function was actually traced
    backend_compiles: int = 0  # XLA compiles plus persistent-cache loads
    cache_hits: int = 0
    cache_misses: int = 0
    compile_seconds: float = 0.0  # XLA compiles plus persistent-cache loads
    trace_seconds: float = 0.0

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
            count.real_traces += seconds >= REAL_TRACE_S
            count.trace_seconds += seconds
        elif name == _BACKEND:
            count.backend_compiles += 1
            count.compile_seconds += seconds


def _on_event(name: str, **_) -> None:
    for count in _active:
        if name == _CACHE_HIT:
            count.cache_hits += 1
        elif name == _CACHE_MISS:
            count.cache_misses += 1


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


# ------------------------------------------------------------------------------------------------
# The persistent compilation cache
# ------------------------------------------------------------------------------------------------

CACHE_ENV = "JAXSPEC_CACHE_DIR"
_enabled_dir: list[str | None] = [None]


def default_cache_dir() -> Path:
    """$JAXSPEC_CACHE_DIR, else the platform's per-user cache dir (XDG on Linux) + jaxspec/xla."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    if sys.platform == "darwin":
        base = Path.home() / "Library" / "Caches"
    elif os.name == "nt":
        base = Path(os.environ.get("LOCALAPPDATA", Path.home() / "AppData" / "Local"))
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "jaxspec" / "xla"


def check_cache_dir(cache_dir: str | os.PathLike) -> Path:
    """Create cache_dir if needed and prove it is writable; raise ValueError naming it otherwise.
    Nothing is left behind on failure."""
    path = Path(cache_dir).expanduser()
    if path.exists() and not path.is_dir():
        raise ValueError(f"cache_dir={str(path)!r} exists and is not a directory")
    created = not path.exists()
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".jaxspec-write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        if created and path.is_dir() and not any(path.iterdir()):
            path.rmdir()
        raise ValueError(f"cache_dir={str(path)!r} is not writable ({e.strerror}); pass a writable "
                         f"directory, set {CACHE_ENV}, or disable the cache (cache_dir=None / --no-cache)") from None
    return path


def enable_persistent_cache(cache_dir: str | os.PathLike | None = "default") -> Path | None:
    """Turn on JAX's persistent compilation cache in cache_dir ("default" = default_cache_dir()),
    caching every executable however small (min compile time 0, min entry size -1). None turns
    it off. Returns the directory in use."""
    import jax

    if cache_dir is None:
        jax.config.update("jax_enable_compilation_cache", False)
        _reset_jax_cache()
        _enabled_dir[0] = None
        return None
    path = check_cache_dir(default_cache_dir() if cache_dir == "default" else cache_dir)
    if _enabled_dir[0] == str(path):
        return path
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    _reset_jax_cache()
    _enabled_dir[0] = str(path)
    return path


def _reset_jax_cache() -> None:
    """JAX decides once per process whether the persistent cache is in use and creates its cache
    object once; reset both so that a new directory, or the cache turned off, takes effect (without
    it, cache_dir=None after a cached load kept writing to the old directory)."""
    try:
        from jax.experimental.compilation_cache import compilation_cache as cc

        cc.reset_cache()
    except (ImportError, AttributeError):
        pass


# ------------------------------------------------------------------------------------------------
# The bucket table: every executable generate can use for a model's settings
# ------------------------------------------------------------------------------------------------

SAMPLING_MODES = ("greedy", "sample")  # a round's static sampling mode: all rows greedy, or any sampled


@dataclass(frozen=True)
class Bucket:
    """One executable. Key = (num_tokens, num_reqs, uniform query length), as vLLM's BatchDescriptor;
    engine_k is the k_max its caches are sized for; rounds (decode / verify) also carry their
    sampling mode and the rounds per dispatch."""

    name: str  # "prefill" | "decode" | "verify[<method>]" | "draft_prefill" | "prefill_hidden" | "admit[...]" | ...
    num_reqs: int
    query_len: int
    engine_k: int = 0
    k: int = 0
    method: str | None = None
    sampling: str = ""  # rounds only: "greedy" | "sample"
    steps: int = 0  # rounds only: rounds per dispatch
    tp: int = 1  # devices of the mesh the executable is SPMD over (the model's tensor_parallel_size)

    @property
    def num_tokens(self) -> int:
        return self.num_reqs * self.query_len

    def describe(self) -> str:
        tp = f" tp={self.tp}" if self.tp > 1 else ""
        if not self.num_reqs:  # cache allocation
            return f"caches k_max={self.engine_k}{tp}"
        if not self.query_len:  # a per-request state update at admission
            return f"one slot k={self.k}{tp}"
        k = f" k={self.k}" if self.k else ""
        rounds = f" {self.sampling} x{self.steps}" if self.steps else ""
        return (f"R={self.num_reqs} T={self.query_len} tokens={self.num_tokens}{k}{rounds}{tp} "
                f"(caches k_max={self.engine_k})")


def draft_for(draft_model, method: str | None):
    """The drafter argument of one method: draft_model itself, or its entry when it is a dict
    {method: draft} (a table with several methods that each need their own: draft_model, eagle3,
    dflash). Tap drafters' entries are loaded heads (jaxspec.speculative.<method>.load)."""
    return draft_model.get(method) if isinstance(draft_model, dict) else draft_model


def bucket_table(model, *, k_values=(), methods=("ngram",), draft_model=None, sampling=SAMPLING_MODES,
                 dynamic_k: bool = False) -> list[Bucket]:
    """The exact set of executables generate uses for these settings: plain prefill + decode per
    request bucket, and for each speculative k (per_k) or the padded maximum (pad_to_max) one
    verify round per method and request bucket, plus the drafters' admission executables. Rounds
    come in each of the `sampling` modes ("greedy": every row greedy; "sample": any row sampled).
    dynamic_k: each k is also the largest k of a dynamic-k call, which adds the rounds of its
    smaller k buckets on k's engine. draft_model: see draft_for."""
    buckets = model.engine_config(0).request_buckets
    chunk, steps = model.prefill_chunk, model.rounds_per_dispatch
    k_values = tuple(sorted(set(k_values)))
    bad = [m for m in sampling if m not in SAMPLING_MODES]
    if bad or not sampling:
        raise ValueError(f"sampling={tuple(sampling)!r}: choose from {SAMPLING_MODES}")
    table: list[Bucket] = []

    def engine_k(k):
        return max(k, model.max_num_speculative_tokens)

    tp = sharding.tp_size(model.config)

    def add(entry):
        entry = dataclasses.replace(entry, tp=tp)
        if entry not in table:
            table.append(entry)

    def engine_entries(k, prefill: bool):
        add(Bucket("allocate", 0, 0, engine_k(k)))
        add(Bucket("set_sampling", 1, 0, engine_k(k)))
        if prefill:  # one request per call, and up to Model.prefill_rows of them for waves of admissions
            for rows in prefill_row_buckets(model.prefill_rows):
                add(Bucket("prefill", rows, chunk, engine_k(k)))

    pad = model.decode_pad  # plain decode steps carry `pad` inert columns (Model.decode_pad)
    engine_entries(pad, True)
    for mode in sampling:
        for r in buckets:
            add(Bucket("decode", r, 1 + pad, engine_k(pad), sampling=mode, steps=steps))
    run_ks = k_values if model.k_mode == "per_k" else ((model.max_num_speculative_tokens,) if k_values else ())
    if dynamic_k:
        _check_dynamic_table(model, methods)
    for k in run_ks:
        extra = []
        for method in methods:
            for kr in k_buckets(k) if dynamic_k else (k,):
                for mode in sampling:
                    for r in buckets:
                        extra.append(Bucket(f"verify[{method}]", r, 1 + kr, engine_k(k), kr, method, mode, steps))
            for fields in SESSIONS[method].admission_buckets(model, k, engine_k(k), chunk,
                                                             draft_for(draft_model, method)):
                fields = {"k": k, "method": method, **fields}
                if fields["name"] == "admit":
                    fields["name"] = f"admit[{method}]"
                extra.append(Bucket(**fields))
        engine_entries(k, any(SESSIONS[m].plain_prefill for m in methods))
        for entry in extra:
            add(entry)
    return table


def _check_dynamic_table(model, methods) -> None:
    from jaxspec.speculative.config import DYNAMIC_K_METHODS

    if model.k_mode != "per_k":
        raise ValueError(f"dynamic_k=True chooses among per-k executables; k_mode={model.k_mode!r} runs every k "
                         f"with the k_max one; use k_mode='per_k'")
    bad = [m for m in methods if m not in DYNAMIC_K_METHODS]
    if bad:
        raise ValueError(f"dynamic_k=True does not support method={bad[0]!r}; valid: {', '.join(DYNAMIC_K_METHODS)}")


def format_table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=False)]
    line = lambda r: "  ".join(str(x).ljust(w) for x, w in zip(r, widths, strict=False))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def print_table(table: list[Bucket]) -> str:
    return format_table([[b.name, b.describe()] for b in table], ["executable", "bucket"])


# ------------------------------------------------------------------------------------------------
# Ahead-of-time precompilation of the table
# ------------------------------------------------------------------------------------------------

@dataclass
class CompileReport:
    bucket: Bucket
    seconds: float
    cache: str  # "hit" | "miss" | "memory" (already compiled in this process) | "off"
    memory_bytes: int | None  # temp + generated code, where memory_analysis() reports it


def _shape(shape, dtype):
    import jax

    return jax.ShapeDtypeStruct(tuple(shape), dtype)


def _loop_state(ecfg):
    """Abstract engine.LoopState, as engine.init_loop_state allocates it."""
    import jax
    import jax.numpy as jnp

    from jaxspec.engine import init_loop_state

    return jax.eval_shape(lambda: jax.tree_util.tree_map(jnp.asarray, init_loop_state(ecfg)))


def _placed(model, args):
    """Abstract arguments with the shardings the run gives them (jaxspec.sharding.abstract): the
    executable compiled ahead of time is then the one the run looks up."""
    from jaxspec import sharding

    return sharding.abstract(args, model.config.mesh)


def _engine_args(model, ecfg):
    """(params, cache shapes, loop state shapes) exactly as an Engine passes them."""
    from jaxspec import cache

    return model.params, cache.cache_shapes(model.config, ecfg, model.dtype), _loop_state(ecfg)


def lower_prefill(model, ecfg, C: int, with_hidden: bool = False, taps: tuple[int, ...] = (), rows: int = 1):
    """The prefill chunk executable of an engine for `rows` requests' chunks (also a drafter's own
    prefill; with taps, the prefill that hands a tap drafter its layers' hidden states)."""
    import jax.numpy as jnp

    from jaxspec import ops
    from jaxspec.engine import prefill_executable

    fn = prefill_executable(model.config, ecfg, ops.resolve_kernels(model.kernels), with_hidden, tuple(taps))
    per_row = _shape((rows,), jnp.int32)
    return fn.lower(*_placed(model, (*_engine_args(model, ecfg), _shape((rows, C), jnp.int32), per_row, per_row,
                                     per_row)))


def _lower_set_sampling(model, ecfg):
    import jax.numpy as jnp

    from jaxspec.engine import set_slot

    settings = dict(temperature=_shape((), jnp.float32), top_k=_shape((), jnp.int32), top_p=_shape((), jnp.float32),
                    seed=_shape((), jnp.uint32), request_id=_shape((), jnp.int32))
    return set_slot.lower(*_placed(model, (_loop_state(ecfg), _shape((1,), jnp.int32), settings)))


def _lower_round(model, ecfg, bucket: Bucket, draft_model):
    import jax.numpy as jnp

    from jaxspec import ops
    from jaxspec.speculative.round import round_executable

    k = bucket.k if bucket.method else bucket.query_len - 1  # a plain decode's inert columns
    session = SESSIONS[bucket.method]
    draft_model = draft_for(draft_model, bucket.method)
    drafter = session.make_drafter(model, ecfg, k, draft_model=draft_model)
    dparams, dstate, aux = session.abstract(model, ecfg, drafter, draft_model)
    fn = round_executable(model.config, ecfg, drafter, ops.resolve_kernels(model.kernels),
                          bucket.sampling == "greedy", bucket.steps)
    i32 = jnp.int32
    return fn.lower(*_placed(model, (*_engine_args(model, ecfg), dparams, dstate, _shape((bucket.num_reqs,), i32),
                                     _shape((), i32), aux)))


def lower_bucket(model, bucket: Bucket, draft_model=None):
    """The Lowered executable of one bucket, built from abstract shapes (nothing is allocated)."""
    import jax.numpy as jnp

    from jaxspec import cache

    ecfg = model.engine_config(bucket.engine_k)
    if bucket.name == "allocate":
        return cache.allocate_executable(model.config, ecfg, jnp.dtype(model.dtype)).lower()
    if bucket.name == "set_sampling":
        return _lower_set_sampling(model, ecfg)
    if bucket.name == "prefill":
        return lower_prefill(model, ecfg, bucket.query_len, rows=bucket.num_reqs)
    if bucket.name == "prefill_hidden":
        return lower_prefill(model, ecfg, bucket.query_len, with_hidden=True)
    if bucket.name == "decode" or bucket.name.startswith("verify["):
        return _lower_round(model, ecfg, bucket, draft_model)
    return SESSIONS[bucket.method].lower_admission(model, ecfg, bucket, draft_for(draft_model, bucket.method))


def step_collectives(model, table: list[Bucket]) -> list[tuple[Bucket, dict[str, int]]]:
    """The collectives (all-reduce, all-gather, ...) in the compiled HLO of each decode / verify round
    of the largest request bucket in greedy mode: what one step pays for tensor parallelism."""
    from jaxspec.sharding import count_collectives

    top = max((b.num_reqs for b in table if b.steps), default=0)
    rounds = [b for b in table if b.steps and b.num_reqs == top and b.sampling == "greedy"]
    return [(b, count_collectives(lower_bucket(model, b).compile().as_text())) for b in rounds]


def _memory(compiled) -> int | None:
    try:
        stats = compiled.memory_analysis()
    except Exception:  # some backends do not implement it
        return None
    if stats is None:
        return None
    return int(getattr(stats, "temp_size_in_bytes", 0) + getattr(stats, "generated_code_size_in_bytes", 0))


def precompile(model, table: list[Bucket], *, draft_model=None, progress: bool = True) -> list[CompileReport]:
    """Lower and compile every bucket of the table (AOT), recording time, persistent-cache hit or
    miss and executable memory. Raises on the first failure."""
    import time

    from tqdm import tqdm

    reports = []
    for bucket in tqdm(table, desc="precompile", disable=not progress, unit="exe"):
        start = time.perf_counter()
        with count_compiles() as count:
            compiled = lower_bucket(model, bucket, draft_model).compile()
        seconds = time.perf_counter() - start
        if _enabled_dir[0] is None:
            status = "off"
        elif count.cache_misses:
            status = "miss"
        elif count.cache_hits:
            status = "hit"
        else:
            status = "memory"
        reports.append(CompileReport(bucket, seconds, status, _memory(compiled)))
    return reports


def format_reports(reports: list[CompileReport]) -> str:
    rows = [[r.bucket.name, r.bucket.describe(), f"{r.seconds:.2f}", r.cache,
             "-" if r.memory_bytes is None else f"{r.memory_bytes / 2**20:.2f} MiB"] for r in reports]
    return format_table(rows, ["executable", "bucket", "compile s", "cache", "exe memory"])


def check_table_memory(model, table: list[Bucket], draft_model=None, budget: int | None = None) -> None:
    """Refuse, before anything is allocated or compiled, a table whose largest engine (weights +
    caches, plus the draft model's caches or the MTP head's KV pools, as the run would allocate
    them) does not fit the device (or the given budget)."""
    from jaxspec import cache
    from jaxspec.engine import memory_plan

    budget = budget if budget is not None else cache.budget_of(model)
    for k in sorted({b.engine_k for b in table}):
        ecfg = model.engine_config(k)
        plan = memory_plan(model, ecfg)
        for method, mk in sorted({(b.method, b.k) for b in table if b.method and b.engine_k == k}):
            plan.update(SESSIONS[method].memory(model, ecfg, mk, draft_for(draft_model, method)))  # as the run
        cache.check_budget(plan, budget)
