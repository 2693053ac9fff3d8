#!/usr/bin/env python
"""Soak (issue 17): waves of random requests for --minutes, checking after every wave that nothing
leaked or drifted.

A wave is one generate call of 1..2*max_num_seqs requests (so requests join while others run) with
random prompt lengths, per-request output lengths, stop ids (some), sampling settings (greedy or
seeded temperature / top-k / top-p) and a random method (plain, ngram, draft_model, mtp); one wave
in four is streamed and abandoned halfway. The KV pool is small enough to force preemption. After
every wave: every slot and page of every engine is free; no compilation happened (the bucket
table is precompiled, then every executable of it run once); the host memory the process holds
(RSS less what malloc keeps free) and device memory in use stay within a margin of their
post-warm-up values; and (float32) one greedy request of the wave, run alone, gives the same
tokens. Uses the trained demo pair. Prints a table and writes JSON, with every wave's memory; the
JSON holds the record so far every --progress-every seconds, and SIGTERM / SIGINT end the waves
early with the record written whole (marked stopped_by_signal).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ctypes  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import resource  # noqa: E402
import signal  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

from benchmarks import common  # noqa: E402
from benchmarks.common import log  # noqa: E402

SMOKE = dict(minutes=0.2, repeats=1)
METHODS = (None, "ngram", "draft_model", "mtp")
K = 2
SETTINGS = dict(dtype="float32", max_model_len=96, max_num_seqs=3, prefill_chunk=16, page_size=8)
POOL = 1 + 20  # pages of 8: one request of up to 96 positions fits alone, three long ones do not
HOST_MARGIN = 64 * 2**20  # bytes of held host memory growth tolerated after warm-up (host_bytes)
DEVICE_MARGIN = 16 * 2**20
MiB = 2**20
# Warm-up requests (run_every_executable): prompts of 1/2, 3/2 and 5/2 prefill chunks, admitted
# together, take prefill calls of 3, 2 and then 1 rows; output lengths this far apart (a round emits
# at most 1 + K tokens) make the requests end one after another: rounds of 3, 2 and then 1 rows.
WARM_PROMPTS = tuple(SETTINGS["prefill_chunk"] * halves // 2 for halves in (1, 3, 5))
WARM_NEW_TOKENS = (2, 8, 40)


def parse(argv=None):
    p = common.parser(__doc__.split("\n\n")[0], shapes=False)
    p.add_argument("--minutes", type=float, default=10.0, help="how long to run waves after warm-up")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kernels", default="auto", choices=["auto", "xla", "pallas"])
    p.add_argument("--progress-every", type=float, default=30.0,
                   help="seconds between rewrites of the JSON with the record so far (its 'progress' entry)")
    return common.parse_args(p, argv, SMOKE, check=False)


def models(kernels: str):
    import jaxspec

    target = jaxspec.load("demo", kernels=kernels, num_kv_pages=POOL, **SETTINGS)
    target = dataclasses.replace(target, config=target.config.replace(eos_token_ids=()), _engines={})
    return target, jaxspec.load("demo-draft", kernels=kernels, **SETTINGS)


def warm_up(target, draft) -> None:
    """Compile every executable the waves can use (both sampling modes, every method at K), then run
    each of them once."""
    from jaxspec import compile as jc

    table = jc.bucket_table(target, k_values=(K,), methods=("ngram", "draft_model", "mtp"), draft_model=draft)
    jc.precompile(target, table, draft_model=draft, progress=False)
    run_every_executable(target, draft)


def run_every_executable(target, draft) -> None:
    """Run every executable of the bucket table once: every method in both sampling modes, with
    prefills of 3, 2 and 1 rows and rounds of 3, 2 and 1 rows (WARM_PROMPTS, WARM_NEW_TOKENS).
    Precompiling is not enough for the memory baseline: the first call of each executable (for
    each request bucket) still allocates host memory that it keeps, on XLA:CPU ~1-2 MiB of native
    heap each: with four random waves as the only warm-up, the executables they had not run grew
    the bytes malloc has in use by 34-38 MiB over the next 30 waves, in steps on the waves that
    first called one (jax's dispatch cache missed), flat after that."""
    import numpy as np

    import jaxspec

    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 250, n).tolist() for n in WARM_PROMPTS]
    sampled = dict(temperature=1.0, top_k=20, top_p=0.9, seed=1)
    for method in METHODS:
        for sampling in ({}, sampled):
            jaxspec.generate(target, prompts, max_new_tokens=list(WARM_NEW_TOKENS),
                             speculative=speculative(method, draft), **sampling)


def speculative(method, draft):
    import jaxspec

    if method is None:
        return None
    return jaxspec.SpeculativeConfig(method, K, draft_model=draft if method == "draft_model" else None)


def random_wave(rng, target, draft) -> dict:
    n = int(rng.integers(1, 2 * target.max_num_seqs + 1))
    prompts = [rng.integers(0, 250, int(rng.integers(1, 40))).tolist() for _ in range(n)]
    news = [int(rng.integers(1, 48)) for _ in range(n)]
    wave = dict(prompts=prompts, max_new_tokens=news, speculative=speculative(METHODS[rng.integers(len(METHODS))],
                                                                              draft))
    if rng.random() < 0.3:
        wave["stop_token_ids"] = [int(rng.integers(0, 250))]
    if rng.random() < 0.5:
        wave.update(temperature=float(rng.uniform(0.3, 1.5)), top_k=int(rng.integers(0, 50)),
                    top_p=float(rng.uniform(0.5, 1.0)), seed=int(rng.integers(0, 2**31)))
    return wave


def idle(*models_) -> bool:
    for m in models_:
        for eng in m._engines.values():
            if sorted(eng.free_slots) != list(range(1, eng.ecfg.max_num_seqs + 1)) or eng.slot_pages \
                    or eng.pages.num_free != eng.ecfg.total_pages - 1:
                return False
    return True


def host_bytes() -> int:
    """Host memory the process holds: its resident set less the bytes glibc's malloc keeps free for
    reuse. After warm-up the bytes malloc has in use stay flat, yet its heaps grow in steps for
    hundreds of waves (RSS +57 MiB over 400 CPU waves, all of it free chunks): the compiles freed
    large mmapped blocks, which raised glibc's dynamic mmap threshold, so the waves' multi-MB
    transient buffers come from the heaps, which keep them, too fragmented to give back (with the
    threshold pinned, MALLOC_MMAP_THRESHOLD_=131072, RSS stays flat). Those bytes are the
    allocator's, not the program's; leaked bytes are held: malloc'd (arrays, device buffers on CPU,
    native state), Python objects (pymalloc's own arenas) or mapped, they stay in the resident set
    and out of malloc's free bytes."""
    return rss_bytes() - malloc_free_bytes()


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


@functools.cache
def mallinfo2():
    """glibc's mallinfo2 (glibc >= 2.33), or None (another C library); looked up once."""
    try:
        fn = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    return fn


def malloc_free_bytes() -> int:
    """Free bytes in glibc malloc's heaps, every arena and its top chunk included; 0 without
    mallinfo2, so that host_bytes is then the plain resident set."""
    info = mallinfo2()
    return 0 if info is None else info().fordblks


def device_bytes() -> int | None:
    import jax

    return (jax.devices()[0].memory_stats() or {}).get("bytes_in_use")


def run_wave(rng, target, draft) -> dict:
    """One wave: generate (or a stream abandoned halfway) and the alone check, then the checks."""
    from jaxspec.compile import count_compiles

    wave = random_wave(rng, target, draft)
    prompts = wave.pop("prompts")
    out = {"requests": len(prompts), "method": getattr(wave["speculative"], "method", "plain"),
           "sampled": "temperature" in wave, "streamed": bool(rng.random() < 0.25)}
    with count_compiles() as c:  # the alone run included: it must not compile either
        result = generate_wave(target, prompts, wave, out["streamed"])
        if result is not None and not out["sampled"]:
            out["alone_equal"] = same_alone(rng, target, prompts, wave, result)
    # real traces and XLA compiles (cache loads included); microsecond trace events are dispatch-cache
    # lookups served by the trace cache (jaxspec.compile.REAL_TRACE_S), not compiles
    out.update(compiles=c.real_traces + c.backend_compiles, idle=idle(target, draft),
               preemptions=result.stats.preemptions if result else None, tokens=result.stats.tokens if result else 0)
    return out


def generate_wave(target, prompts, wave: dict, streamed: bool):
    """The wave's generate call; a stream is read a quarter of the way, then closed (no result)."""
    import jaxspec

    if not streamed:
        return jaxspec.generate(target, prompts, **wave)
    stream = jaxspec.generate(target, prompts, stream=True, **wave)
    total = sum(wave["max_new_tokens"])
    for i, _ in enumerate(stream):
        if i >= total // 4:
            break
    stream.close()
    return None


def same_alone(rng, target, prompts, wave: dict, result) -> bool:
    """One greedy request of the wave, run alone, must give the same tokens."""
    import jaxspec

    i = int(rng.integers(len(prompts)))
    alone = jaxspec.generate(target, [prompts[i]], **{**wave, "max_new_tokens": wave["max_new_tokens"][i]})
    return alone.token_ids[0] == result.token_ids[i]


def memory_now() -> dict:
    rss, free = rss_bytes(), malloc_free_bytes()
    return {"host": rss - free, "rss": rss, "malloc_free": free, "device": device_bytes()}


def memory_growth(base: dict) -> dict:
    """Growth since the post-warm-up baseline, bytes: host (held: the check), rss and malloc_free
    (its two parts, for diagnosis) and device (None where the device reports no memory stats)."""
    now = memory_now()
    growth = {f"{k}_growth": now[k] - base[k] for k in ("host", "rss", "malloc_free")}
    device = None if now["device"] is None or base["device"] is None else now["device"] - base["device"]
    return growth | {"device_growth": device}


def memory_record(index: int, w: dict) -> dict:
    """The JSON's per-wave memory entry (every wave, not only failing ones): what ran, growth in MiB."""
    mib = {k.removesuffix("_growth") + "_mb": None if w[k] is None else round(w[k] / MiB, 2)
           for k in ("host_growth", "rss_growth", "malloc_free_growth", "device_growth")}
    return {"wave": index, "method": w["method"], "requests": w["requests"], "sampled": w["sampled"],
            "streamed": w["streamed"], "alone": "alone_equal" in w, **mib}


def problems_of(w: dict) -> list[str]:
    return [name for name, bad in (("compiled", w["compiles"] > 0), ("leaked", not w["idle"]),
                                   ("output", w.get("alone_equal") is False),
                                   ("host memory", w["host_growth"] > HOST_MARGIN),
                                   ("device memory", (w["device_growth"] or 0) > DEVICE_MARGIN)) if bad]


def log_first_failures(failures: list[dict]) -> None:
    """Log the newest failure's problems that no earlier wave had, with the wave's record, as they
    happen: a run stopped before its end writes no summary, and its log must still say what failed."""
    seen = {p for f in failures[:-1] for p in f["problems"]}
    new = [p for p in failures[-1]["problems"] if p not in seen]
    if new:
        log(f"  first {', '.join(new)} failure: {failures[-1]}")


def soak(seconds: float, seed: int = 0, kernels: str = "auto", log_every: int = 20, progress=None,
         progress_every_s: float = 30.0) -> dict:
    """Run waves for `seconds` after warm-up; returns the record (waves, failures, memory by wave).
    progress(rec), if given, is called with the record so far every progress_every_s seconds.
    SIGTERM or SIGINT end the waves early; the record is still returned whole (stopped_by_signal)."""
    import numpy as np

    target, draft = models(kernels)
    t0 = time.perf_counter()
    warm_up(target, draft)
    rng = np.random.default_rng(seed)
    for _ in range(4):  # random waves too (streams closed early, preemptions, alone runs) before the baseline
        run_wave(rng, target, draft)
    base = memory_now()
    rec = {"warm_up_s": time.perf_counter() - t0, "waves": [], "failures": [], "memory": []}
    start = last = time.perf_counter()
    stop = StopFlag()
    while time.perf_counter() - start < seconds and not stop.set:
        w = run_wave(rng, target, draft)
        w.update(memory_growth(base))
        problems = problems_of(w)
        if problems:
            rec["failures"].append({"wave": len(rec["waves"]), "problems": problems, **w})
            log_first_failures(rec["failures"])
        rec["memory"].append(memory_record(len(rec["waves"]), w))
        rec["waves"].append(w)
        if log_every and len(rec["waves"]) % log_every == 0:
            log(f"  {len(rec['waves'])} waves, {sum(x['requests'] for x in rec['waves'])} requests, "
                f"{len(rec['failures'])} failures")
        if progress and time.perf_counter() - last >= progress_every_s:
            last = time.perf_counter()
            progress(summarise(rec, start))
    stop.restore()
    rec = summarise(rec, start)
    if stop.set:
        log(f"  stopped by signal {stop.set} after {rec['seconds']:.0f} s of waves")
        rec["stopped_by_signal"] = stop.set
    return rec


def summarise(rec: dict, start: float) -> dict:
    """The record with its totals filled in (the waves so far)."""
    return rec | {"seconds": time.perf_counter() - start, "requests": sum(w["requests"] for w in rec["waves"]),
                  "preemptions": sum(w["preemptions"] or 0 for w in rec["waves"]),
                  "alone_checked": sum("alone_equal" in w for w in rec["waves"]),
                  "host_growth_max_mb": max((m["host_mb"] for m in rec["memory"]), default=0.0),
                  "rss_growth_max_mb": max((m["rss_mb"] for m in rec["memory"]), default=0.0)}


class StopFlag:
    """SIGTERM / SIGINT end the waves after the current one (so `timeout` or a stopped job still
    leaves a complete record); .set holds the signal's number once one came."""

    def __init__(self):
        self.set = 0
        main = threading.current_thread() is threading.main_thread()  # only there can handlers be set
        self.old = {sig: signal.signal(sig, self._handler) for sig in (signal.SIGTERM, signal.SIGINT)} if main else {}

    def _handler(self, signum, frame) -> None:
        self.set = signum

    def restore(self) -> None:
        for sig, handler in self.old.items():
            signal.signal(sig, handler)


def main(argv=None) -> int:
    args = parse(argv)
    res = common.Results("soak", args)

    def progress(rec: dict) -> None:  # the record so far, so a run cut short still leaves its numbers
        res.data["progress"] = record_of(rec)
        res.save()

    rec = soak(args.minutes * 60, args.seed, args.kernels, progress=progress, progress_every_s=args.progress_every)
    res.data.pop("progress", None)
    res.add(record_of(rec))
    res.finish()
    print_tables(res)
    return 1 if rec["failures"] else 0


def record_of(rec: dict) -> dict:
    return {k: v for k, v in rec.items() if k != "waves"} | {"wave_count": len(rec["waves"])}


def print_tables(res) -> None:
    rows = [[r["wave_count"], r["requests"], r["preemptions"], r["alone_checked"], len(r["failures"]),
             f"{r['host_growth_max_mb']:.1f}", f"{r['rss_growth_max_mb']:.1f}", f"{r['seconds']:.0f}",
             f"{r['warm_up_s']:.0f}"] for r in res.data["results"]]
    print("\nsoak (failures: a leak, a compile after warm-up, memory growth or an output that differs alone)")
    print(common.format_table(rows, ["waves", "requests", "preemptions", "checked alone", "failures",
                                     "max host MiB", "max RSS MiB", "s", "warm-up s"]))


if __name__ == "__main__":
    sys.exit(main())
