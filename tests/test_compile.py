"""Executable caching (issue 5): the bucket table, persistent-cache hits across processes, zero
compilations when serving after precompile, and refusals of bad settings."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec import compile as jc
from jaxspec.compile import count_compiles

# Two rounds per dispatch and two prompts per prefill call: the multi-step and two-row prefill
# executables are in the table and served from the cache too.
MODEL = ["--model", "demo:qwen3", "--max-model-len", "48", "--max-num-seqs", "2", "--prefill-chunk", "16",
         "--rounds-per-dispatch", "2", "--prefill-rows", "2"]
REPO = Path(__file__).resolve().parents[1]

GENERATE_SCRIPT = """
import json, sys
import jaxspec
from jaxspec.compile import count_compiles
cache = sys.argv[1] if sys.argv[1] != "none" else None
with count_compiles() as c:
    m = jaxspec.load("demo:qwen3", max_model_len=48, max_num_seqs=2, prefill_chunk=16, cache_dir=cache,
                     rounds_per_dispatch=2, prefill_rows=2)
    spec = jaxspec.SpeculativeConfig("ngram", 2)
    r = jaxspec.generate(m, ["abcabcab", "hello"], max_new_tokens=6, speculative=spec)
    p = jaxspec.generate(m, ["xyz"], max_new_tokens=4)
    s = jaxspec.generate(m, ["xyz", "uvw"], max_new_tokens=4, temperature=0.8, top_k=5, speculative=spec)
print(json.dumps({"tokens": r.token_ids + p.token_ids + s.token_ids, "compiles": c.compiles,
                  "hits": c.cache_hits}))
"""


def run(args: list[str], env_cache: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    if env_cache is not None:
        env["JAXSPEC_CACHE_DIR"] = str(env_cache)
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=600)


def cli(*args: str, cache: Path | None = None) -> subprocess.CompletedProcess:
    return run(["-m", "jaxspec.cli", *args], cache)


@pytest.fixture(scope="module")
def precompiled(tmp_path_factory):
    """Two precompile runs in fresh processes over one cache directory."""
    cache = tmp_path_factory.mktemp("xla")
    first = cli("precompile", *MODEL, "--k", "2", "--cache-dir", str(cache))
    second = cli("precompile", *MODEL, "--k", "2", "--cache-dir", str(cache))
    return cache, first, second


def report_rows(stdout: str) -> list[list[str]]:
    """Rows of the compile report table (the lines after its header)."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("executable") and "cache" in line)
    rows = []
    for line in lines[start + 2:]:
        if not line.strip() or line[0].isdigit():
            break
        rows.append(line.split())
    return rows


def test_count_compiles_counts_a_fresh_compile():
    """Positive control for the zero-recompile tests: a function jitted for the first time is
    traced and compiled inside count_compiles; calling it again with the same shapes is neither."""
    f = jax.jit(lambda x: jnp.sin(x) * 3.0 + 1.0)  # a new function: no executable of it exists yet
    x = np.arange(7, dtype=np.float32)
    with count_compiles() as first:
        f(x).block_until_ready()
    assert first.traces > 0 and first.backend_compiles > 0, first
    assert first.compiles == first.backend_compiles - first.cache_hits
    with count_compiles() as again:
        f(x).block_until_ready()
    assert again.traces == 0 and again.backend_compiles == 0, again
    with count_compiles() as other_shape:
        f(np.arange(9, dtype=np.float32)).block_until_ready()
    assert other_shape.traces > 0 and other_shape.backend_compiles > 0, other_shape


def test_table_lists_every_executable():
    model = jaxspec.load("demo:qwen3", max_model_len=48, max_num_seqs=4, prefill_chunk=16, cache_dir=None)
    table = jc.bucket_table(model, k_values=(1, 3), methods=("ngram", "replay"))
    names = [(b.name, b.num_reqs, b.query_len) for b in table]
    for r in (1, 2, 4):
        assert ("decode", r, 1) in names
        for k in (1, 3):
            assert ("verify[ngram]", r, 1 + k) in names and ("verify[replay]", r, 1 + k) in names
    assert all(b.num_tokens == b.num_reqs * b.query_len for b in table)
    assert "verify[ngram]" in jc.print_table(table)


def test_pad_to_max_table_has_one_verify_per_bucket():
    model = jaxspec.load("demo:qwen3", max_model_len=48, max_num_seqs=2, prefill_chunk=16, cache_dir=None,
                         max_num_speculative_tokens=4, k_mode="pad_to_max")
    table = jc.bucket_table(model, k_values=(1, 2, 4), methods=("ngram",))
    verifies = [b for b in table if b.name.startswith("verify")]
    assert sorted((b.num_reqs, b.query_len, b.sampling) for b in verifies) == [
        (1, 5, "greedy"), (1, 5, "sample"), (2, 5, "greedy"), (2, 5, "sample")]


def test_first_precompile_compiles_second_is_served_from_cache(precompiled):
    _, first, second = precompiled
    assert first.returncode == 0, first.stderr
    assert second.returncode == 0, second.stderr
    rows1, rows2 = report_rows(first.stdout), report_rows(second.stdout)
    assert len(rows1) == len(rows2) >= 6
    assert any(r[0].startswith("verify") for r in rows2)
    assert all("miss" in r for r in rows1)
    assert all("hit" in r for r in rows2), second.stdout
    assert "0 compiled" in second.stdout


def test_generate_after_precompile_compiles_nothing(precompiled, tmp_path):
    cache, _, _ = precompiled
    warm = run(["-c", GENERATE_SCRIPT, str(cache)])
    assert warm.returncode == 0, warm.stderr
    warm = json.loads(warm.stdout.strip().splitlines()[-1])
    assert warm["compiles"] == 0 and warm["hits"] > 0
    cold = run(["-c", GENERATE_SCRIPT, "none"])
    assert cold.returncode == 0, cold.stderr
    assert json.loads(cold.stdout.strip().splitlines()[-1])["tokens"] == warm["tokens"]


def test_verbose_generate_reports_startup(precompiled):
    cache, _, _ = precompiled
    out = cli("generate", *MODEL, "--max-new-tokens", "4", "--cache-dir", str(cache), "--verbose", "hi")
    assert out.returncode == 0, out.stderr
    assert "time to first token" in out.stderr and "0 XLA compilations" in out.stderr
    from benchmarks.startup import PHASES, STARTUP_LINE

    phases = PHASES.search(out.stderr)  # the split benchmarks/startup.py records
    assert STARTUP_LINE.search(out.stderr) and phases, out.stderr
    assert float(phases["command"]) >= float(STARTUP_LINE.search(out.stderr)["ttft"])


@pytest.mark.parametrize("flags, message", [
    (["--k", "0"], "k=0 must be >= 1"),
    (["--max-num-seqs", "0"], "max-num-seqs=0 must be >= 1"),
])
def test_bad_flags_exit_nonzero(flags, message, tmp_path):
    cache = tmp_path / "cache"
    out = cli("precompile", *MODEL, *flags, "--cache-dir", str(cache))
    assert out.returncode != 0
    assert message in out.stderr
    assert not cache.exists()


OFF_SCRIPT = """
import sys
from pathlib import Path
import jax, jax.numpy as jnp
from jaxspec import compile as jc
cache = Path(sys.argv[1])
jc.enable_persistent_cache(cache)
jax.jit(lambda x: x + 1)(jnp.ones(3)).block_until_ready()
on = len(list(cache.rglob("*")))
jc.enable_persistent_cache(None)
jax.jit(lambda x: x * 3)(jnp.ones(5)).block_until_ready()
print(on, len(list(cache.rglob("*"))))
"""


def test_cache_dir_none_stops_writes_in_a_process_that_cached(tmp_path):
    """cache_dir=None after a cached load must turn JAX's cache off, not only its config flag: jax
    decides once per process whether the cache is used (the tensor-parallel tests load with
    cache_dir=None after other files cached, and kept serializing executables)."""
    out = run(["-c", OFF_SCRIPT, str(tmp_path / "xla")])
    assert out.returncode == 0, out.stderr
    on, off = map(int, out.stdout.split()[-2:])
    assert on >= 1 and off == on, out.stdout


def test_missing_model_and_unwritable_cache_dir(tmp_path):
    cache = tmp_path / "cache"
    out = cli("precompile", "--model", str(tmp_path / "nope"), "--cache-dir", str(cache))
    assert out.returncode != 0 and "does not exist" in out.stderr
    assert not cache.exists()
    blocker = tmp_path / "file"
    blocker.write_text("")
    out = cli("precompile", *MODEL, "--cache-dir", str(blocker / "cache"))
    assert out.returncode != 0 and ("not writable" in out.stderr or "not a directory" in out.stderr), out.stderr
    assert blocker.read_text() == ""


@pytest.mark.parametrize("family, bodies", [("qwen3", 1), ("qwen3_5", 2)])
def test_layers_are_traced_once_per_layer_shape(family, bodies):
    """Every decoder layer calls one lowered body per distinct layer shape (one for Qwen3; GDN and
    attention for the hybrids) instead of inlining its own copy: what keeps a warm start's tracing and
    lowering independent of depth (docs/benchmarks.md, "Compile and start-up")."""
    model = jaxspec.load(f"demo:{family}", cache_dir=None)
    text = jc.lower_prefill(model, model.engine_config(0), 16).as_text()
    assert len(set(re.findall(r"func\.func private @(_layer\w*)", text))) == bodies
    assert len(re.findall(r"call @_layer", text)) == model.config.num_hidden_layers
