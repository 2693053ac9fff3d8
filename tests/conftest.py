"""Session-scoped fixtures shared by the whole suite."""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Four virtual CPU devices for the tensor-parallel tests (tests/test_tensor_parallel.py); set before
# jax starts its backend. Measured on 2 cores: the other tests run no slower with them.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()

# Compile for speed of compiling: the suite's tiny models spend most of their CPU time in XLA:CPU's
# backend compile (test_loading.py alone: 59 of ~90 s, 82 executables), not in running them. These
# flags cut that compile time 2.4x and the suite's CPU time about 2x (docs/testing.md); they change
# code generation (and so float32 rounding: see test_rollback.py below), not the operations
# computed. Benchmarks and users never see them. Probed first in a
# child process: an XLA that does not know one of them aborts at start-up.
FAST_COMPILE_FLAGS = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true",
                      "--xla_cpu_use_fusion_emitters=false", "--xla_cpu_use_xnnpack=false",
                      "--xla_cpu_parallel_codegen_split_count=1")


def _fast_compile_flags() -> str:
    if os.environ.get("JAXSPEC_TEST_FAST_COMPILE", "1") == "0":
        return ""
    flags = " ".join(FAST_COMPILE_FLAGS)
    probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices('cpu')"], capture_output=True,
                           env=dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu"), timeout=120)
    return flags if probe.returncode == 0 else ""


if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _fast_compile_flags()).strip()

import pytest  # noqa: E402

from tests.hf_fixtures import make_hf_checkpoint  # noqa: E402

# The suite's persistent compilation cache: a fresh directory per run, never the user's cache. The
# process that starts the run makes it; pytest-xdist workers and the subprocesses of tests inherit it,
# so an executable one worker compiled is a cache hit for the other. The starting process removes it.
_RUN_CACHE_ENV = "JAXSPEC_TEST_RUN_CACHE_DIR"
_made_run_cache = not os.environ.get(_RUN_CACHE_ENV)
if _made_run_cache:
    os.environ[_RUN_CACHE_ENV] = tempfile.mkdtemp(prefix="jaxspec-test-xla-cache-")
os.environ["JAXSPEC_CACHE_DIR"] = os.environ[_RUN_CACHE_ENV]


def pytest_unconfigure(config):
    if _made_run_cache:
        shutil.rmtree(os.environ[_RUN_CACHE_ENV], ignore_errors=True)


@pytest.fixture(autouse=True, scope="module")
def _release_executables():
    """XLA:CPU maps each compiled kernel into memory regions of its own (~400 mappings per
    executable of these tiny models). One xdist worker of a full run reached 64,391 mappings of
    Linux's default vm.max_map_count of 65,530 with only tests/speculative releasing its
    executables; past the limit the compiler segfaults. Drop the compiled executables after every
    module (a later use reloads them from the run's persistent compilation cache)."""
    yield
    import jax

    jax.clear_caches()


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory) -> Callable[..., Path]:
    """Factory: hf_checkpoint(kind, **options) -> directory of a tiny random HF checkpoint
    (tests/hf_fixtures.make_hf_checkpoint), built once per (kind, options) for the session.
    Treat the directory as read-only; copy it before modifying."""
    cache: dict[str, Path] = {}

    def get(kind: str, **options: Any) -> Path:
        key = json.dumps([kind, options], sort_keys=True)
        if key not in cache:
            directory = tmp_path_factory.mktemp(f"hf_{kind}")
            cache[key] = make_hf_checkpoint(kind, directory, **options)
        return cache[key]

    return get


# ---- Files whose tests run in a fresh process ------------------------------------------------
# jaxlib 0.10's XLA:CPU segfaulted compiling (or serializing) a tensor-parallel prefill executable
# when the process had already run other test files first: in 4 of 4 full-suite runs, and in one
# process running 6 of the suite's files before it; never in a fresh process (the file alone
# passed 4 of 4). A crashed worker ends the whole run, so these files run in a child pytest of
# their own, once per session, and each of their tests reports the child's outcome for it
# (docs/benchmarks.md, "Tensor parallelism").
#
# A file can also need XLA's default code generation: test_rollback.py compares the GDN state of the
# verify path with plain decoding at a relative RMS of 1e-5 (both float32, differing by rounding
# only); without LLVM's optimisations (no fused multiply-adds) the two paths round apart to 1.36e-5,
# so that file runs without FAST_COMPILE_FLAGS; test_incremental.py likewise (a Qwen3-Next decode
# rounds apart from the full forward by 2.1e-5 under those flags, 1.6e-6 without them).
# file -> runs with the default code generation.
FRESH_PROCESS_FILES = {"test_tensor_parallel.py": False, "test_rollback.py": True, "test_incremental.py": True}
_CHILD_ENV = "JAXSPEC_TEST_FRESH_PROCESS"
_CHILD_TIMEOUT_S = 1100  # under the suite's per-test timeout (pyproject.toml), which the first test pays
_child_results: dict[Path, dict[str, tuple[str, str]]] = {}


def pytest_collection_modifyitems(config, items):
    if os.environ.get(_CHILD_ENV):
        return
    for item in items:
        if item.path.name in FRESH_PROCESS_FILES and isinstance(item, pytest.Function):
            item.setup = lambda: None  # no fixtures here: the child builds them
            item.runtest = functools.partial(_report_child_outcome, item)


def _report_child_outcome(item) -> None:
    results = _child_results.get(item.path)
    if results is None:
        names = [i.nodeid for i in item.session.items if i.path == item.path]
        results = _child_results[item.path] = _run_child(item.config.rootpath, names,
                                                         default_codegen=FRESH_PROCESS_FILES[item.path.name])
    kind, text = results.get(item.name, ("missing", results[""][1]))
    if kind == "skipped":
        pytest.skip(text)
    if kind != "passed":
        pytest.fail(f"in a fresh process ({kind}):\n{text}", pytrace=False)


def _run_child(rootdir: Path, nodeids: list[str], *, default_codegen: bool) -> dict[str, tuple[str, str]]:
    """{test name: (passed | skipped | failure | error, text)} from `pytest nodeids` in a new
    process; key "" holds the tail of its output (read when a test did not report at all)."""
    env = dict(os.environ, **{_CHILD_ENV: "1"})
    if default_codegen:
        env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split() if f not in FAST_COMPILE_FLAGS)
        env["JAXSPEC_TEST_FAST_COMPILE"] = "0"
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", *nodeids]
        try:
            proc = subprocess.run(cmd, cwd=rootdir, env=env, capture_output=True, text=True,
                                  timeout=_CHILD_TIMEOUT_S)
            output = proc.stdout[-4000:] + proc.stderr[-4000:]
        except subprocess.TimeoutExpired as e:
            output = f"timed out after {_CHILD_TIMEOUT_S} s\n{(e.stdout or b'')[-4000:]!r}"
        results = {"": ("missing", output)}
        if report.is_file():
            for case in ET.parse(report).getroot().iter("testcase"):
                kind, text = "passed", ""
                for child in case:
                    if child.tag in ("failure", "error", "skipped"):
                        kind, text = child.tag, (child.get("message") or "") + "\n" + (child.text or "")
                        break
                results[case.get("name")] = (kind, text)
    return results
