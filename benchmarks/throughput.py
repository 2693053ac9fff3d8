#!/usr/bin/env python
"""Throughput under load (issue 17): batches of mixed requests through one `jaxspec.generate` call.

Each batch size B runs B requests whose prompt and output lengths are drawn uniformly from
--prompt-lens and --new-tokens (fixed seed), plain and speculative (ngram, and replay at --alpha
with the speculative path's own greedy output as reference), for each k in --ks. Reported per run:
output tok/s, time to first token and per-token latency (p50 / p99 over requests and tokens, from
a streamed run's arrival times: the host sees a dispatch's tokens when it reads it back), the KV
pool's peak occupancy, the preemptions and the prefill calls. The engine holds max(--batches) slots;
--num-kv-pages shrinks the pool to force preemption. With --requests-per-slot W > 1 a cell is
sustained load instead of one wave: B x W requests through an engine of B slots (max_num_seqs = B),
so a finished request's slot is refilled at once and the batch stays full until the last W-th of the
work (B = 1 runs W requests one after another). --profile adds, per cell, one call inside a
jax.profiler trace: its device-busy time, kernel count and top kernels beside its wall time. Where
speculation stops paying as B grows, the verify is no longer flat in t: compare each speculative
row's tok/s with plain at the same B.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import time  # noqa: E402

from benchmarks import common  # noqa: E402
from benchmarks.common import fmt, log  # noqa: E402

SMOKE = dict(shapes="demo-qwen3.5", batches="1,3", prompt_lens="4,20", new_tokens="4,12", methods="plain,ngram,replay",
             ks="2", repeats=1)
METHODS = ("plain", "ngram", "replay")


def parse(argv=None):
    p = common.parser(__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,8,32,64", help="requests per generate call")
    p.add_argument("--prompt-lens", default="32,512", help="min,max prompt tokens")
    p.add_argument("--new-tokens", default="32,256", help="min,max generated tokens per request")
    p.add_argument("--requests-per-slot", type=int, default=1,
                   help="W: each cell runs B x W requests through B slots (1 = one wave of B requests, all slots "
                        "of max(--batches))")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--ks", default="3,7", help="draft lengths of the speculative runs")
    p.add_argument("--alpha", type=float, default=0.8, help="replay acceptance rate")
    p.add_argument("--num-kv-pages", type=int, default=None, help="KV pool size (default: from the memory budget)")
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="prompt tokens per prefill call row (default: the engine's 'auto', 512 on GPUs)")
    p.add_argument("--prefill-rows", type=lambda t: t if t == "auto" else int(t), default="auto",
                   help="requests whose prompt chunks share a prefill call ('auto': the engine's default)")
    p.add_argument("--profile", action="store_true",
                   help="per cell, one more call inside a jax.profiler trace: device-busy seconds, kernel count and "
                        "the top kernels beside that call's wall time (wall far above busy: the host)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--kernels", default="auto", choices=["auto", "xla", "pallas"])
    p.add_argument("--cache-dir", default="default", help="persistent XLA cache ('none' = off)")
    p.set_defaults(repeats=3)  # every cell: one warm-up run, then the median of 3 timed runs
    args = common.parse_args(p, argv, SMOKE)
    common.check_choices("--methods", args.methods, METHODS, "method")
    batches, ks = common.int_list(args.batches), common.int_list(args.ks)
    lo_hi = [common.int_list(args.prompt_lens), common.int_list(args.new_tokens)]
    if any(len(x) != 2 or x[0] > x[1] or x[0] < 1 for x in lo_hi):
        raise SystemExit("--prompt-lens and --new-tokens take min,max with 1 <= min <= max")
    base = common.SMOKE_ENGINE if args.smoke else common.ENGINE
    need = lo_hi[0][1] + lo_hi[1][1] + max(ks) + 1
    if args.requests_per_slot < 1:
        raise SystemExit(f"--requests-per-slot takes a positive count, got {args.requests_per_slot}")
    if args.prefill_chunk is not None and args.prefill_chunk < 1:
        raise SystemExit(f"--prefill-chunk takes a positive token count, got {args.prefill_chunk}")
    if args.prefill_rows != "auto" and not 1 <= args.prefill_rows <= max(batches):
        raise SystemExit(f"--prefill-rows takes 1..{max(batches)} (the largest batch), got {args.prefill_rows}")
    from jaxspec.loader import auto_prefill_chunk

    max_len = max(base["max_model_len"], need)
    chunk = args.prefill_chunk or (base["prefill_chunk"] if args.smoke else auto_prefill_chunk(max_len))
    args.engine = dict(base, max_num_seqs=max(batches), max_model_len=max_len, max_num_speculative_tokens=max(ks),
                       num_kv_pages=args.num_kv_pages, prefill_chunk=chunk, prefill_rows=args.prefill_rows)
    args.batch_list, args.k_list, (args.prompt_range, args.new_range) = batches, ks, lo_hi
    return args


def workload(batch: int, args, vocab: int) -> tuple[list[list[int]], list[int]]:
    """batch x --requests-per-slot prompts and output lengths, drawn from a seed that depends on those
    two numbers only (one wave keeps the seed of earlier runs)."""
    import numpy as np

    waves = args.requests_per_slot
    rng = np.random.default_rng(1000 + batch + (0 if waves == 1 else 1_000_000 * waves))
    lens = rng.integers(args.prompt_range[0], args.prompt_range[1] + 1, batch * waves)
    news = rng.integers(args.new_range[0], args.new_range[1] + 1, batch * waves)
    return [rng.integers(0, min(vocab, 32000), int(n)).tolist() for n in lens], [int(n) for n in news]


def percentile(values, q: float):
    import numpy as np

    return float(np.percentile(values, q)) if len(values) else None


def timed_stream(model, prompts, news, spec) -> dict:
    """One streamed generate call: arrival times per request, pool occupancy, stats."""
    import jaxspec

    start = time.perf_counter()
    first, gaps, last = {}, [], {}
    engine_pages = []
    stream = jaxspec.generate(model, prompts, max_new_tokens=news, speculative=spec, stream=True)
    for index, new in stream:
        now = time.perf_counter() - start
        if index not in first:
            first[index] = now
        elif new:  # tokens of one read-back arrive together: spread the gap over them
            gaps += [(now - last[index]) / len(new)] * len(new)
        last[index] = now
        eng = next(iter(model._engines.values()), None)
        if eng is not None:
            engine_pages.append((eng.ecfg.total_pages - 1 - eng.pages.num_free) / (eng.ecfg.total_pages - 1))
    wall = time.perf_counter() - start
    s = stream.stats
    return {"wall_s": wall, "tokens": s.tokens, "tokens_per_s": s.tokens / wall, "tau": s.tau,
            "preemptions": s.preemptions, "prefill_calls": s.prefill_steps,
            "ttft_p50_ms": percentile(list(first.values()), 50) * 1e3,
            "ttft_p99_ms": percentile(list(first.values()), 99) * 1e3,
            "token_latency_p50_ms": percentile(gaps, 50) and percentile(gaps, 50) * 1e3,
            "token_latency_p99_ms": percentile(gaps, 99) and percentile(gaps, 99) * 1e3,
            "pool_peak": max(engine_pages, default=None)}


def profiled_stream(model, prompts, news, spec, top: int = 8) -> dict:
    """timed_stream inside a jax.profiler trace: its wall time and TTFT beside the device-busy time
    (sum of kernel durations; the profiler turns XLA's command buffers off, so busy is an upper
    bound), the kernel count and the kernels that took longest, with the prefill calls counted."""
    import tempfile

    import jax

    from benchmarks.profile_step import _kernel_events, top_kernels

    with tempfile.TemporaryDirectory(prefix="jaxspec-throughput-") as trace_dir:
        with jax.profiler.trace(trace_dir):
            run = timed_stream(model, prompts, news, spec)
        events = _kernel_events(trace_dir)
    return {"wall_s": run["wall_s"], "ttft_p99_ms": run["ttft_p99_ms"], "prefill_calls": run["prefill_calls"],
            "device_busy_s": sum(d for _, _, d in events) / 1e9, "kernels": len(events),
            "top": [{"name": n[:160], "ms": t / 1e6, "calls": c} for n, t, c in top_kernels(events, top)]}


def configs(args) -> list[tuple[str, int]]:
    out = [("plain", 0)] if "plain" in args.methods else []
    return out + [(m, k) for m in ("ngram", "replay") if m in args.methods for k in args.k_list]


def run_batch(model, batch: int, args, res, budget) -> None:
    from benchmarks.e2e import _replay_reference
    from jaxspec.speculative.config import SpeculativeConfig

    prompts, news = workload(batch, args, model.config.vocab_size)
    plain = None
    for method, k in configs(args):
        what = f"B={batch} {method}" + (f" k={k}" if k else "")
        if not budget.allows():
            res.skip(what, "budget")
            continue
        try:
            spec = None
            if method == "ngram":
                spec = SpeculativeConfig("ngram", k)
            elif method == "replay":
                if plain is None:
                    plain = _plain_tokens(model, prompts, news)
                ref, _ = _replay_reference(model, prompts, news, plain, [{"method": "replay", "k": k}])
                spec = SpeculativeConfig("replay", k, replay_tokens=ref, replay_alpha=args.alpha)
            timed_stream(model, prompts, news, spec)  # warm: every bucket the run passes through
            runs = [timed_stream(model, prompts, news, spec) for _ in range(args.repeats)]
            item = sorted(runs, key=lambda r: r["tokens_per_s"])[len(runs) // 2]
            if args.profile:
                item["profile"] = prof = profiled_stream(model, prompts, news, spec)
                log(f"  {what} profiled: wall {prof['wall_s']:.3f} s, device busy {prof['device_busy_s']:.3f} s, "
                    f"{prof['kernels']} kernels, {prof['prefill_calls']} prefill calls, top {prof['top'][:2]}")
            res.add({"batch": batch, "requests": len(prompts), "method": method, "k": k, **item})
            log(f"  {what}: {item['tokens_per_s']:.1f} tok/s, ttft p50 {fmt(item['ttft_p50_ms'], 1)} ms, "
                f"pool peak {fmt(item['pool_peak'])}, {item['preemptions']} preemptions")
        except Exception as e:
            res.error(what, e)
            model._engines.clear()


def _plain_tokens(model, prompts, news) -> list[list[int]]:
    import jaxspec

    return jaxspec.generate(model, prompts, max_new_tokens=news).token_ids


def main(argv=None) -> int:
    from jaxspec.loader import AUTO_PREFILL_ROWS

    args = parse(argv)
    names = common.shape_names(args.shapes, ("demo-qwen3.5",) if args.smoke else ("qwen3-4b", "qwen3.5-2b"))
    layers = common.parse_layers(args.layers, names)
    res = common.Results("throughput", args)
    res.data["cache_dir"] = common.setup_jax(args.cache_dir)
    budget = common.Budget(args.budget_s)
    for name in names:
        engine = {k: v for k, v in args.engine.items() if k != "num_kv_pages"}
        model = common.build_model(common.shape_config(name, layers[name]), dtype=args.dtype, kernels=args.kernels,
                                   engine=engine)
        model.num_kv_pages = args.num_kv_pages
        ecfg = model.engine_config(max(args.k_list))
        res.data.setdefault("pools", {})[name] = {"pages": ecfg.total_pages - 1, "page_size": ecfg.page_size}
        log(f"{name}: KV pool {ecfg.total_pages - 1} pages of {ecfg.page_size}")
        for batch in args.batch_list:
            before = len(res.data["results"])
            if args.requests_per_slot > 1:  # sustained load: B slots, so B = 1 runs its requests in turn
                model._engines.clear()
                model.max_num_seqs = batch
                rows = AUTO_PREFILL_ROWS if args.prefill_rows == "auto" else args.prefill_rows
                model.prefill_rows = min(rows, batch)
            run_batch(model, batch, args, res, budget)
            for r in res.data["results"][before:]:
                r["shape"] = name
        del model
    res.finish()
    print_tables(res)
    return 0


def print_tables(res) -> None:
    rows = [[r.get("shape", ""), r["batch"], r.get("requests", r["batch"]), r["method"], r["k"] or "",
             fmt(r["tokens_per_s"], 1), fmt(r["tau"]), fmt(r["ttft_p50_ms"], 1), fmt(r["ttft_p99_ms"], 1),
             fmt(r["token_latency_p50_ms"], 2), fmt(r["token_latency_p99_ms"], 2), fmt(r["pool_peak"]),
             r["preemptions"]] for r in res.data["results"]]
    print("\nthroughput (one generate call per row; latency from streamed arrival times)")
    print(common.format_table(rows, ["shape", "B", "requests", "method", "k", "tok/s", "tau", "ttft p50", "ttft p99",
                                     "tok p50 ms", "tok p99 ms", "pool peak", "preempt"]))


if __name__ == "__main__":
    sys.exit(main())
