"""Ways to move a safetensors file's tensors to the default device, timed in one process, to find
where a warm start's weight load goes on a host (docs/benchmarks.md, "Compile and start-up").

usage: python tools/load_paths.py PARAMS.safetensors OUT.json   (e.g. a jaxspec.save directory's file)
       python tools/load_paths.py --fresh PARAMS.safetensors OUT.json

Variants, in this order (the page cache warms as they go, so later reads see a hotter file): one
sequential read; jaxspec's own restore (saved.restore_params); slab reads of the whole file into one
buffer with 1-16 threads; device_put of the buffer's tensor views (serial, threaded, one batched
call); the whole buffer as one array; host -> pinned host -> device; memory-mapped views put by 8
threads; a read into fresh memory and a put per tensor by 8 and 16 threads. Prints seconds and GB/s
per variant and writes them as JSON.

--fresh: what a start-up pays, each probe in a new process (twice), as a warm start sees it: the
backend's start (jax.devices()), its first 16-byte device_put (where the backend reserves its memory
pool unless XLA_PYTHON_CLIENT_PREALLOCATE=false), positioned reads of every tensor into fresh memory
(8 threads), their device_put by 8 threads (first and second time in the process), and jaxspec's own
restore after the backend start. One JSON line per process in OUT.json's "fresh" list.
"""

from __future__ import annotations

import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from jaxspec import saved, weights  # noqa: E402

CHUNK = 1 << 26  # bytes per positioned read of the slab variants


def read_at(fd: int, buf: np.ndarray, offset: int) -> None:
    """Fill buf (uint8) from the file at offset."""
    view, got = memoryview(buf), 0
    while got < len(view):
        got += os.preadv(fd, [view[got:]], offset + got)


class Bench:
    def __init__(self, path: str):
        self.path, self.size, self.results = path, os.path.getsize(path), {"file_bytes": os.path.getsize(path)}
        self.start, self.header = weights.read_header(path)
        self.items = [v for k, v in self.header.items() if k != "__metadata__"]

    def record(self, name: str, seconds: float) -> None:
        self.results[name] = seconds
        print(f"{name:42s} {seconds:8.3f} s  {self.size / seconds / 1e9:6.2f} GB/s", flush=True)

    def timed(self, name: str, fn):
        """fn() -> jax arrays (or a host buffer); timed until ready, device arrays freed after."""
        start = time.perf_counter()
        out = jax.block_until_ready(fn())
        self.record(name, time.perf_counter() - start)
        for a in jax.tree_util.tree_leaves(out):
            if isinstance(a, jax.Array):
                a.delete()
        return out

    def views(self, buf: np.ndarray) -> list[np.ndarray]:
        return list(weights.tensor_views(buf[self.start:], self.header).values())

    def slab(self, threads: int) -> np.ndarray:
        buf = np.empty(self.size, np.uint8)
        fd = os.open(self.path, os.O_RDONLY)
        try:
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(lambda off: read_at(fd, buf[off:off + CHUNK], off), range(0, self.size, CHUNK)))
        finally:
            os.close(fd)
        return buf

    def read_and_put(self, v: dict, put: bool = True):
        """One tensor read into fresh memory, then put on the default device (put=False: the host array)."""
        lo, hi = v["data_offsets"]
        raw = np.empty(hi - lo, np.uint8)
        fd = os.open(self.path, os.O_RDONLY)
        try:
            read_at(fd, raw, self.start + lo)
        finally:
            os.close(fd)
        host = weights.tensor_views(raw, {"t": dict(v, data_offsets=[0, hi - lo])})["t"]
        return jax.device_put(host) if put else host


def sequential_read(path: str) -> None:
    with open(path, "rb") as f:
        while f.read(1 << 28):
            pass


def threaded(fn, items, threads: int) -> list:
    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(fn, items))


def probe(path: str) -> dict:
    """One fresh process's start-up phases (--fresh), seconds."""
    b, out = Bench(path), {}

    def timed(name, fn):
        start = time.perf_counter()
        result = jax.block_until_ready(fn())
        out[name] = round(time.perf_counter() - start, 4)
        return result

    timed("backend_start_s", jax.devices)
    timed("first_put_s", lambda: jax.device_put(np.zeros(4, np.float32)))
    host = timed("read_8_threads_s", lambda: threaded(lambda v: b.read_and_put(v, put=False), b.items, 8))
    for n in ("put_8_threads_s", "put_again_8_threads_s"):
        for a in jax.tree_util.tree_leaves(timed(n, lambda: threaded(jax.device_put, host, 8))):
            a.delete()
    timed("jaxspec_restore_s", lambda: saved.restore_params(Path(path).parent, jnp.bfloat16))
    return {"file_bytes": b.size, "preallocate": os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE"), **out}


def fresh(path: str, runs: int = 2) -> list[dict]:
    """probe() in `runs` new processes for each setting of the backend's pool reservation."""
    import subprocess

    lines = []
    for preallocate in ("true", "false"):
        env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE=preallocate)
        for _ in range(runs):
            proc = subprocess.run([sys.executable, __file__, "--probe", path], env=env, capture_output=True,
                                  text=True, check=True)
            lines.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(json.dumps(lines[-1]), flush=True)
    return lines


def main(argv: list[str]) -> int:
    if argv[:1] == ["--probe"] and len(argv) == 2:
        print(json.dumps(probe(argv[1])))
        return 0
    if argv[:1] == ["--fresh"] and len(argv) == 3:
        Path(argv[2]).write_text(json.dumps({"fresh": fresh(argv[1])}, indent=1))
        return 0
    if len(argv) != 2:
        raise SystemExit(__doc__)
    b = Bench(argv[0])
    b.timed("read 256 MiB chunks, 1 thread", lambda: sequential_read(b.path))
    b.timed("A saved.restore_params", lambda: saved.restore_params(Path(b.path).parent, jnp.bfloat16))
    for n in (1, 4, 8, 16):
        buf = b.timed(f"B slab read, {n} threads", lambda n=n: b.slab(n))
    views = b.views(buf)
    b.timed("C put views, serial", lambda: [jax.device_put(v) for v in views])
    for n in (4, 8, 16):
        b.timed(f"C put views, {n} threads", lambda n=n: threaded(jax.device_put, views, n))
    b.timed("C put views, one batched call", lambda: jax.device_put(views))
    b.timed("D put the whole buffer as one array", lambda: jax.device_put(buf))
    device = jax.devices()[0]
    try:
        pinned = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
        start = time.perf_counter()
        host = jax.block_until_ready(jax.device_put(buf, pinned))
        b.record("E host -> pinned host", time.perf_counter() - start)
        b.timed("E pinned host -> device", lambda: jax.device_put(host, jax.sharding.SingleDeviceSharding(device)))
        host.delete()
    except Exception as e:  # a backend without pinned host memory
        b.results["E_error"] = repr(e)[:300]
        print("E pinned host memory:", b.results["E_error"])
    mapped = list(weights.open_checkpoint(b.path).values())
    b.timed("F memory-mapped views, put by 8 threads", lambda: threaded(jax.device_put, mapped, 8))
    for n in (8, 16):
        b.timed(f"G read + put per tensor, {n} threads", lambda n=n: threaded(b.read_and_put, b.items, n))
    Path(argv[1]).write_text(json.dumps(b.results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
