#!/usr/bin/env python
"""Tensor parallelism (issue 15, item 6): the decode step and the verify round (T = 1 + k) at each
--tps size, batch 1 and 8, for the published shapes (random weights generated straight into their
shards), the collectives each step compiles to, the all-reduce share of a profiled decode step, and
end-to-end plain and speculative (replay, alpha 0.8, k 7) decoding. A shape that does not fit one
device (Qwen3-Next-80B-A3B in bf16) runs only at the sizes that hold it; a size the devices or the
shape do not allow is recorded as skipped with the reason.

Step times come from benchmarks/step_times.py's machinery (the engine's own round executables, rows
at --context cached tokens, pipelined and per-call medians); the per-device floor is the step's
bytes (common.step_bytes) over the measured bandwidth, divided by the TP size. The all-reduce share
is the summed duration of the profiled kernels whose name says all-reduce (NCCL's included) over the
summed duration of every kernel of the traced decode steps (every device's).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gc  # noqa: E402
import re  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402

from benchmarks import common, profile_step, step_times  # noqa: E402
from benchmarks.common import fmt, log  # noqa: E402

SHAPES = ("qwen3-4b", "qwen3.5-27b", "qwen3-next-80b-a3b")
SMOKE = dict(shapes="demo-qwen3", tps="1,2", batches="1,2", ks="3", context=24, repeats=3,
             pipeline=2, warmup=1, new_tokens=8, e2e_k=3, traced=2, bandwidth_gib=1 / 32, compile_threads=2)
ALL_REDUCE = re.compile(r"all[-_]?reduce|AllReduce", re.IGNORECASE)


def build_parser():
    p = common.parser(__doc__.split("\n\n")[0])
    p.set_defaults(shapes=",".join(SHAPES))
    p.add_argument("--tps", default="1,2", help="tensor-parallel sizes")
    p.add_argument("--batches", default="1,8", help="request counts (each its own bucket)")
    p.add_argument("--ks", default="7", help="draft lengths k of the timed verify rounds (T = 1+k)")
    p.add_argument("--context", type=int, default=512, help="tokens already cached in every row")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--kernels", default="auto", choices=["auto", "xla", "pallas"])
    p.add_argument("--pipeline", type=int, default=8, help="calls per pipelined sample")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--traced", type=int, default=5, help="decode steps in the profile")
    p.add_argument("--new-tokens", type=int, default=128, help="end to end: tokens generated per prompt")
    p.add_argument("--e2e-k", type=int, default=7, help="end to end: replay drafts per round (alpha 0.8)")
    p.add_argument("--compile-threads", type=int, default=common.default_threads())
    p.add_argument("--bandwidth-gib", type=float, default=4.0, help="array size of the bandwidth reduction")
    p.add_argument("--cache-dir", default="default", help="persistent XLA cache ('none' = off)")
    return p


def parse(argv=None):
    args = common.parse_args(build_parser(), argv, SMOKE)
    args.names = common.shape_names(args.shapes, SHAPES)
    args.layer_counts = common.parse_layers(args.layers, args.names)
    args.engine = dict(common.SMOKE_ENGINE if args.smoke else common.ENGINE,
                       max_num_speculative_tokens=max(common.int_list(args.ks) + [args.e2e_k]))
    args.moe_paths = "none"
    return args


def allreduce_share(model, eng, args, trace_root: str) -> dict:
    """Profile --traced decode steps at batch 1: all-reduce kernel time over all kernel time."""
    makers, inputs = step_times._batch_inputs(model, eng, 1, [], args.context)
    compiled, errors, _, _ = common.lower_and_compile(makers, 1)
    if errors:
        return {"error": str(errors)[:500]}
    st = {"caches": eng.caches, "state": step_times.loop_state(eng, 1, args.context), "dstate": {0: None}}
    call = step_times._caller(("decode", 0), compiled[("decode", 0)], model, st, inputs[("decode", 0)])
    common.block(call())
    trace_dir = tempfile.mkdtemp(dir=trace_root)
    with jax.profiler.trace(trace_dir):
        out = None
        for _ in range(args.traced):
            out = call()
        common.block(out)
    eng.caches, eng.state = st["caches"], st["state"]
    events = profile_step._kernel_events(trace_dir)
    total = sum(d for _, _, d in events)
    reduce_ns = sum(d for name, _, d in events if ALL_REDUCE.search(name))
    return {"all_reduce_ms_per_step": reduce_ns / 1e6 / args.traced, "busy_ms_per_step": total / 1e6 / args.traced,
            "all_reduce_share": reduce_ns / total if total else None, "kernels": len(events)}


def end_to_end(model, args) -> dict:
    """Plain greedy and replay (alpha 0.8, k) greedy over the batch sizes, tokens/s (median of repeats)."""
    import jaxspec

    out = {}
    for R in common.int_list(args.batches):
        prompts = common.prompt_ids(R, 32, model.config.vocab_size)
        ref = jaxspec.generate(model, prompts, max_new_tokens=args.new_tokens + args.e2e_k + 1).token_ids
        spec = jaxspec.SpeculativeConfig("replay", args.e2e_k, replay_tokens=ref, replay_alpha=0.8)
        for label, sp in (("plain", None), (f"replay a0.8 k{args.e2e_k}", spec)):
            jaxspec.generate(model, prompts, max_new_tokens=8, speculative=sp)  # warm
            runs = []
            for _ in range(args.repeats):
                t = time.perf_counter()
                r = jaxspec.generate(model, prompts, max_new_tokens=args.new_tokens, speculative=sp)
                runs.append(sum(map(len, r.token_ids)) / (time.perf_counter() - t))
            out[f"R={R} {label}"] = {"tok_s": common.median(runs), "tau": r.stats.tau if sp else 1.0}
    return out


def run(name: str, tp: int, args, res, bandwidth: float, trace_root: str) -> None:
    from jaxspec import compile as jc
    from jaxspec import sharding

    hf = common.shape_config(name, args.layer_counts[name])
    cfg = common.model_config(hf)
    if tp > jax.device_count():
        return res.skip(f"{name} tp={tp}", f"{jax.device_count()} device(s) present")
    if tp not in sharding.valid_sizes(cfg):
        return res.skip(f"{name} tp={tp}", f"the shape allows tensor_parallel_size in {sharding.valid_sizes(cfg)}")
    weights = common.params_bytes_by_kind(cfg, args.dtype)
    need = sum(weights.values()) / tp
    have = common.environment().get("device_bytes_limit")
    if have and need > 0.9 * have:
        return res.skip(f"{name} tp={tp}", f"{need / common.GiB:.0f} GiB of weights per device > 90% of "
                                           f"{have / common.GiB:.0f} GiB")
    t0 = time.perf_counter()
    model = common.build_model(hf, dtype=args.dtype, kernels=args.kernels, engine=args.engine,
                               tensor_parallel_size=tp)
    eng = model.engine(args.engine["max_num_speculative_tokens"])
    placed = jax.tree_util.tree_map(lambda x: x.sharding, eng.caches)  # kept: the random fill is unconstrained
    eng.caches = common.block(jax.device_put(step_times._randomise(eng.caches, jax.random.PRNGKey(7)), placed))
    rec = res.add({"shape": name, "tp": tp, "layers": hf["num_hidden_layers"],
                   "init_s": round(time.perf_counter() - t0, 2), "kernels": eng.kernels,
                   "weights_bytes_per_device": sum(map(sharding.shard_bytes, jax.tree_util.tree_leaves(model.params))),
                   "batches": []})
    log(f"{name} tp={tp}: built in {rec['init_s']}s")
    for R in common.int_list(args.batches):
        try:
            batch = step_times.run_batch(model, eng, R, args, weights, bandwidth)
            for item in batch["items"]:
                if "floor_ms" in item:
                    item["floor_per_device_ms"] = item["floor_ms"] / tp
            rec["batches"].append(batch)
        except Exception as e:
            res.error(f"{name} tp={tp} R={R}", e)
        res.save()
    table = jc.bucket_table(model, k_values=common.int_list(args.ks), methods=("replay",), sampling=("greedy",))
    rec["collectives"] = {b.describe(): counts for b, counts in jc.step_collectives(model, table)}
    for label, fn, fn_args in (("profile", allreduce_share, (model, eng, args, trace_root)),
                               ("e2e", end_to_end, (model, args))):
        try:
            rec[label] = fn(*fn_args)
        except Exception as e:
            res.error(f"{name} tp={tp} {label}", e)
        res.save()
    gc.collect()


def print_tables(res) -> None:
    rows, e2e = [], []
    base = {}
    for rec in res.data["results"]:
        for b in rec["batches"]:
            for i in b["items"]:
                if "error" in i:
                    continue
                key = (rec["shape"], b["R"], i["kind"], i["T"])
                ms = i["pipelined_ms"] or i["latency_ms"]
                if rec["tp"] == 1:
                    base[key] = ms
                ratio = ms / base[key] if key in base and rec["tp"] > 1 else None
                rows.append([rec["shape"], rec["tp"], b["R"], i["kind"], i["T"], fmt(ms, 3),
                             fmt(i["floor_per_device_ms"], 3), fmt(ratio), fmt(ms / i["floor_per_device_ms"])])
        share = (rec.get("profile") or {}).get("all_reduce_share")
        counts = "; ".join(f"{k.split(' (')[0]}: {v}" for k, v in (rec.get("collectives") or {}).items())
        log(f"{rec['shape']} tp={rec['tp']}: all-reduce share {fmt(share and 100 * share, 1)}%; {counts}")
        for label, v in (rec.get("e2e") or {}).items():
            e2e.append([rec["shape"], rec["tp"], label, fmt(v["tok_s"], 1), fmt(v["tau"])])
    print(common.format_table(rows, ["shape", "tp", "R", "step", "T", "ms", "floor/dev", "vs tp1", "x floor"]))
    print(common.format_table(e2e, ["shape", "tp", "run", "tok/s", "tau"]))


def main(argv=None) -> int:
    args = parse(argv)
    common.setup_jax(args.cache_dir)
    res = common.Results("tp", args)
    bandwidth = common.measure_bandwidth(int(args.bandwidth_gib * common.GiB))["bytes_per_s"]
    trace_root = tempfile.mkdtemp(prefix="jaxspec-tp-trace-")
    for name in args.names:
        for tp in common.int_list(args.tps):
            try:
                run(name, tp, args, res, bandwidth, trace_root)
            except Exception as e:
                res.error(f"{name} tp={tp}", e)
    res.finish()
    print_tables(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
