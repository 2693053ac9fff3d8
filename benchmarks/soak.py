#!/usr/bin/env python
"""Soak (issue 17): waves of random requests for --minutes, checking after every wave that nothing
leaked or drifted.

A wave is one generate call of 1..2*max_num_seqs requests (so requests join while others run) with
random prompt lengths, per-request output lengths, stop ids (some), sampling settings (greedy or
seeded temperature / top-k / top-p) and a random method (plain, ngram, draft_model, mtp); one wave
in four is streamed and abandoned halfway. The KV pool is small enough to force preemption. After
every wave: every slot and page of every engine is free; no compilation happened (the bucket
table is precompiled first); host RSS and device memory in use stay within a margin of their
post-warm-up values; and (float32) one greedy request of the wave, run alone, gives the same
tokens. Uses the trained demo pair. Prints a table and writes JSON.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dataclasses  # noqa: E402
import resource  # noqa: E402
import time  # noqa: E402

from benchmarks import common  # noqa: E402
from benchmarks.common import log  # noqa: E402

SMOKE = dict(minutes=0.2, repeats=1)
METHODS = (None, "ngram", "draft_model", "mtp")
K = 2
SETTINGS = dict(dtype="float32", max_model_len=96, max_num_seqs=3, prefill_chunk=16, page_size=8)
POOL = 1 + 20  # pages of 8: one request of up to 96 positions fits alone, three long ones do not
HOST_MARGIN = 64 * 2**20  # bytes of RSS growth tolerated after warm-up (allocator noise)
DEVICE_MARGIN = 16 * 2**20


def parse(argv=None):
    p = common.parser(__doc__.split("\n\n")[0], shapes=False)
    p.add_argument("--minutes", type=float, default=10.0, help="how long to run waves after warm-up")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kernels", default="auto", choices=["auto", "xla", "pallas"])
    return common.parse_args(p, argv, SMOKE, check=False)


def models(kernels: str):
    import jaxspec

    target = jaxspec.load("demo", kernels=kernels, num_kv_pages=POOL, **SETTINGS)
    target = dataclasses.replace(target, config=target.config.replace(eos_token_ids=()), _engines={})
    return target, jaxspec.load("demo-draft", kernels=kernels, **SETTINGS)


def warm_up(target, draft) -> None:
    """Compile every executable the waves can use (both sampling modes, every method at K)."""
    from jaxspec import compile as jc

    table = jc.bucket_table(target, k_values=(K,), methods=("ngram", "draft_model", "mtp"), draft_model=draft)
    jc.precompile(target, table, draft_model=draft, progress=False)


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
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def device_bytes() -> int | None:
    import jax

    return (jax.devices()[0].memory_stats() or {}).get("bytes_in_use")


def run_wave(rng, target, draft) -> dict:
    """One wave: generate (or a stream abandoned halfway), then the checks."""
    import jaxspec
    from jaxspec.compile import count_compiles

    wave = random_wave(rng, target, draft)
    prompts = wave.pop("prompts")
    out = {"requests": len(prompts), "method": getattr(wave["speculative"], "method", "plain"),
           "sampled": "temperature" in wave, "streamed": bool(rng.random() < 0.25)}
    with count_compiles() as c:
        if out["streamed"]:
            stream = jaxspec.generate(target, prompts, stream=True, **wave)
            total = sum(wave["max_new_tokens"])
            for i, _ in enumerate(stream):
                if i >= total // 4:
                    break
            stream.close()
            result = None
        else:
            result = jaxspec.generate(target, prompts, **wave)
    # real traces and XLA compiles (cache loads included); microsecond trace events are dispatch-cache
    # lookups served by the trace cache (jaxspec.compile.REAL_TRACE_S), not compiles
    out.update(compiles=c.real_traces + c.backend_compiles, idle=idle(target, draft),
               preemptions=result.stats.preemptions if result else None, tokens=result.stats.tokens if result else 0)
    if result is not None and not out["sampled"]:  # one request, alone, must give the same tokens
        i = int(rng.integers(len(prompts)))
        alone = jaxspec.generate(target, [prompts[i]], **{**wave, "max_new_tokens": wave["max_new_tokens"][i]})
        out["alone_equal"] = alone.token_ids[0] == result.token_ids[i]
    return out


def soak(seconds: float, seed: int = 0, kernels: str = "auto", log_every: int = 20) -> dict:
    """Run waves for `seconds` after warm-up; returns the record (waves, failures, memory)."""
    import numpy as np

    target, draft = models(kernels)
    t0 = time.perf_counter()
    warm_up(target, draft)
    rng = np.random.default_rng(seed)
    for _ in range(4):  # the first waves allocate the engines and the drafters' state
        run_wave(rng, target, draft)
    host0, dev0 = host_bytes(), device_bytes()
    rec = {"warm_up_s": time.perf_counter() - t0, "waves": [], "failures": []}
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        w = run_wave(rng, target, draft)
        w["host_growth"] = host_bytes() - host0
        dev = device_bytes()
        w["device_growth"] = None if dev is None or dev0 is None else dev - dev0
        problems = [name for name, bad in (("compiled", w["compiles"] > 0), ("leaked", not w["idle"]),
                                           ("output", w.get("alone_equal") is False),
                                           ("host memory", w["host_growth"] > HOST_MARGIN),
                                           ("device memory", (w["device_growth"] or 0) > DEVICE_MARGIN)) if bad]
        if problems:
            rec["failures"].append({"wave": len(rec["waves"]), "problems": problems, **w})
        rec["waves"].append(w)
        if log_every and len(rec["waves"]) % log_every == 0:
            log(f"  {len(rec['waves'])} waves, {sum(x['requests'] for x in rec['waves'])} requests, "
                f"{len(rec['failures'])} failures")
    rec["seconds"] = time.perf_counter() - start
    rec["requests"] = sum(w["requests"] for w in rec["waves"])
    rec["preemptions"] = sum(w["preemptions"] or 0 for w in rec["waves"])
    rec["alone_checked"] = sum("alone_equal" in w for w in rec["waves"])
    return rec


def main(argv=None) -> int:
    args = parse(argv)
    res = common.Results("soak", args)
    rec = soak(args.minutes * 60, args.seed, args.kernels)
    res.add({k: v for k, v in rec.items() if k != "waves"} | {"wave_count": len(rec["waves"])})
    res.finish()
    print_tables(res)
    return 1 if rec["failures"] else 0


def print_tables(res) -> None:
    rows = [[r["wave_count"], r["requests"], r["preemptions"], r["alone_checked"], len(r["failures"]),
             f"{r['seconds']:.0f}", f"{r['warm_up_s']:.0f}"] for r in res.data["results"]]
    print("\nsoak (failures: a leak, a compile after warm-up, memory growth or an output that differs alone)")
    print(common.format_table(rows, ["waves", "requests", "preemptions", "checked alone", "failures", "s",
                                     "warm-up s"]))


if __name__ == "__main__":
    sys.exit(main())
