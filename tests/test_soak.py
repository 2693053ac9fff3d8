"""A short soak (benchmarks/soak.py): random waves of requests (methods, sampling, stops, per-request
lengths, abandoned streams) over a KV pool small enough to preempt, checked after every wave for
leaked pages or slots, compilations after warm-up, memory growth and outputs that differ when the
request runs alone. The GPU run soaks for minutes; here a few waves. Plus positive controls of the
leak check and of the host memory measure."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from benchmarks import soak

REPO = Path(__file__).resolve().parents[1]


def test_short_soak_leaks_nothing_compiles_nothing_and_matches_alone(tmp_path):
    """In its own process, as the GPU run starts it (its memory checks see only the soak)."""
    out = tmp_path / "soak.json"
    env = dict(os.environ, PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "soak.py"), "--smoke", "--kernels", "xla",
                           "--out", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (rec,) = json.loads(out.read_text())["results"]
    assert not rec["failures"], rec["failures"][:3]
    assert rec["wave_count"] >= 3 and rec["requests"] >= 6
    assert rec["alone_checked"] >= 1
    assert [m["wave"] for m in rec["memory"]] == list(range(rec["wave_count"]))  # every wave's memory, recorded


@pytest.mark.skipif(soak.mallinfo2() is None, reason="needs glibc's mallinfo2 (glibc >= 2.33)")
def test_the_host_memory_check_counts_held_memory_not_malloc_free_memory():
    """Positive control for host_bytes: bytes held count in full; freed heap chunks that malloc
    keeps for reuse do not (here each is pinned in place by a small block still held, so they stay
    resident: RSS remains +32 MiB, as the soak's heaps grew)."""
    import numpy as np

    big = np.ones(16 * soak.MiB, np.uint8)  # mmapped; freeing it raises glibc's dynamic mmap threshold
    del big
    before = soak.host_bytes()
    chunks, pins = [], []
    for _ in range(8):
        chunks.append(np.ones(4 * soak.MiB, np.uint8))  # from the heap now, each followed by a pin
        pins.append(np.ones(64 * 1024, np.uint8))
    held = soak.host_bytes() - before
    chunks.clear()
    freed = soak.host_bytes() - before
    assert held >= 30 * soak.MiB, held / soak.MiB
    assert freed < 4 * soak.MiB, freed / soak.MiB


def test_the_leak_check_sees_a_held_page():
    """Positive control for the check every wave relies on."""
    pages = types.SimpleNamespace(num_free=6)
    ecfg = types.SimpleNamespace(max_num_seqs=2, total_pages=8)
    whole = types.SimpleNamespace(free_slots=[2, 1], slot_pages={}, pages=types.SimpleNamespace(num_free=7), ecfg=ecfg)
    held = types.SimpleNamespace(free_slots=[2, 1], slot_pages={}, pages=pages, ecfg=ecfg)
    slot = types.SimpleNamespace(free_slots=[2], slot_pages={1: []}, pages=types.SimpleNamespace(num_free=7), ecfg=ecfg)
    model = lambda engine: types.SimpleNamespace(_engines={"e": engine})  # noqa: E731
    assert soak.idle(model(whole)) and not soak.idle(model(held)) and not soak.idle(model(slot))
