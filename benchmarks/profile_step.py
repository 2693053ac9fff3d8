#!/usr/bin/env python
"""Where one step's time goes (issue 7, the profile note): a jax.profiler trace of the plain decode
step and of the speculative verify round of one shape, reduced to a per-kernel table.

For each step (the engine's decode executable at T = 1, the replay round at T = 1 + k for each --ks,
and the bare forward + argmax at the same T, which isolates the sampler's share): the pipelined and
per-call wall time, the device-busy time (sum of GPU kernel durations per step, from the trace), the
kernel count per step, and the kernels that take the most time, grouped by name. Wall time well
above device-busy time means host launches or synchronisation; device-busy time above the
weight-read floor means slow kernels. The raw trace stays in --trace-dir for TensorBoard / XProf.

pipelined is 8 calls and one wait, so it still holds one call's dispatch and readback; steady is the
per-call wall of a long loop (the slope between 8 and 40 calls, which cancels them): steady above
device busy is the host overhead a long generation loop pays. dispatch is the host time for one
call to return; near steady, the host sets the pace, or a full launch queue makes each call wait for
a slot (then dispatch_idle, a call enqueued on an idle device, in the JSON and log, is the host's own
cost). --rows REGEX keeps only the matching steps.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import collections  # noqa: E402
import functools  # noqa: E402
import re  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import common, step_times  # noqa: E402
from benchmarks.common import fmt, log  # noqa: E402

SMOKE = dict(shapes="demo-qwen3.5", batch=1, ks="1", context=24, repeats=2, traced=2, top=5, prefill_chunks="16")


def parse(argv=None):
    p = common.parser(__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=1, help="requests per step")
    p.add_argument("--ks", default="1,3", help="draft lengths of the verify rounds profiled")
    p.add_argument("--context", type=int, default=512, help="tokens already cached in every row")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--kernels", default="auto", choices=["auto", "xla", "pallas"])
    p.add_argument("--traced", type=int, default=10, help="calls of each step inside the trace")
    p.add_argument("--top", type=int, default=12, help="kernels listed per step")
    p.add_argument("--sequence", action="store_true",
                   help="also keep every kernel of one traced call in launch order (name, microseconds): "
                        "the per-layer anatomy")
    p.add_argument("--trace-dir", default=None, help="keep the raw traces here (default: a temporary directory)")
    p.add_argument("--prefill-chunks", default="",
                   help="also profile the engine's prefill executable of one request at these chunk sizes "
                        "(comma list; its floor is the larger of bytes / bandwidth and FLOPs / matmul rate)")
    p.add_argument("--prefill-rows", default="1",
                   help="requests per prefill call, as Model.prefill_rows packs them "
                        "(comma list; each with each chunk)")
    p.add_argument("--prefill-only", action="store_true", help="profile the prefill chunks only, no decode steps")
    p.add_argument("--fused-projections", action="store_true",
                   help="run the decoder layers' projections through the fused Pallas kernel "
                        "(jaxspec.models.layers.FUSED_KERNEL, off by default; docs/architecture.md)")
    p.add_argument("--gdn-chunk-from", type=int, default=None, metavar="T",
                   help="run GDN verify spans of T tokens and more (powers of two) in chunk form "
                        "(pallas_kernels.gated_delta.recurrent.CHUNK_MIN_T; docs/model_math.md)")
    p.add_argument("--rows", default=None, metavar="REGEX",
                   help="profile only the steps whose label matches this regular expression (re.search; "
                        "default: all)")
    args = common.parse_args(p, argv, SMOKE)
    args.chunk_list = common.int_list(args.prefill_chunks) if args.prefill_chunks else []
    args.rows_list = common.int_list(args.prefill_rows)
    if args.prefill_only and not args.chunk_list:
        raise SystemExit("--prefill-only needs --prefill-chunks")
    try:
        args.rows_re = re.compile(args.rows) if args.rows is not None else None
    except re.error as e:
        raise SystemExit(f"--rows {args.rows!r}: not a regular expression: {e}") from None
    args.engine = common.engine_for_context(common.SMOKE_ENGINE if args.smoke else common.ENGINE, args.context)
    for flag, value in (("--batch", args.batch), ("--prefill-rows", max(args.rows_list))):
        if not 1 <= value <= args.engine["max_num_seqs"]:
            raise SystemExit(f"{flag} {value}: takes 1..max_num_seqs={args.engine['max_num_seqs']}")
    return args


def _forward_argmax(params, caches, num_emitted, inputs, *, cfg, ecfg, kernels):
    """The trunk and a greedy argmax only: the step without the sampler or the loop state."""
    from jaxspec.engine import make_batch
    from jaxspec.models.model import forward

    batch = make_batch(inputs["tokens"], inputs["start_pos"], inputs["num_valid"], inputs["block_tables"],
                       inputs["seq_slot"], num_emitted, ecfg)
    logits, _, caches = forward(params, cfg, caches, batch, mode="verify", kernels=kernels, last_only=False)
    return jnp.argmax(logits, axis=-1).astype(jnp.int32), caches, num_emitted


def _kernel_events(trace_dir: str) -> list[tuple[str, int, int]]:
    """(name, start_ns, duration_ns) of every device kernel in the newest trace under trace_dir; on a
    backend without device planes (CPU) the XLA runtime threads' events stand in."""
    files = sorted(Path(trace_dir).rglob("*.xplane.pb"), key=lambda f: f.stat().st_mtime)
    if not files:
        return []
    data = jax.profiler.ProfileData.from_file(str(files[-1]))
    device = [p for p in data.planes if p.name.startswith("/device:GPU")]
    if device:  # GPU: the stream lines hold kernels and copies; "XLA Ops" / "XLA Modules" summarise them
        lines = [line for p in device for line in p.lines if re.match(r"Stream #\d+", line.name)]
        lines = lines or [line for p in device for line in p.lines if "XLA" not in line.name]
    else:
        lines = [line for p in data.planes if p.name == "/host:CPU" for line in p.lines
                 if line.name.startswith("tf_XLA")]
    return [(e.name, e.start_ns, e.duration_ns) for line in lines for e in line.events]


def top_kernels(events: list[tuple[str, int, int]], top: int) -> list[tuple[str, int, int]]:
    """(name, total_ns, calls) of the `top` kernels by summed duration over _kernel_events."""
    by_name = collections.defaultdict(lambda: [0, 0])
    for name, _, dur in events:
        by_name[name][0] += dur
        by_name[name][1] += 1
    return [(n, t, c) for n, (t, c) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]]


def profile(call, args, name: str, trace_root: str, steps: int = 1) -> dict:
    """Timings per round: a call that runs `steps` rounds is divided by steps."""
    timing = common.time_steps(call, warmup=2, repeats=args.repeats, pipeline=8)
    trace_dir = str(Path(trace_root) / re.sub(r"\W+", "_", name))
    with jax.profiler.trace(trace_dir):
        out = None
        for _ in range(args.traced):
            out = call()
        common.block(out)
    events = _kernel_events(trace_dir)
    per = args.traced * steps
    sequence = call_sequence(events, args.traced) if args.sequence else None
    busy_ms = sum(d for _, _, d in events) / 1e6 / per
    span_ms = ((max(s + d for _, s, d in events) - min(s for _, s, _ in events)) / 1e6 / per
               if events else None)
    return {"step": name, "rounds_per_call": steps, "pipelined_ms": timing["pipelined"]["median_ms"] / steps,
            "steady_ms": timing["steady"]["median_ms"] / steps, "dispatch_ms": timing["dispatch"]["median_ms"] / steps,
            "dispatch_idle_ms": timing["dispatch_idle"]["median_ms"] / steps,
            "latency_ms": timing["latency"]["median_ms"] / steps,
            "device_busy_ms": busy_ms, "device_span_ms": span_ms, "kernels_per_step": len(events) / per,
            "top": [{"name": n[:160], "ms_per_step": t / 1e6 / per, "calls_per_step": c / per}
                    for n, t, c in top_kernels(events, args.top)]} | ({"sequence": sequence} if sequence else {})


def call_sequence(events: list[tuple[str, int, int]], calls: int) -> list[list]:
    """[name, microseconds] of the kernels of the second traced call (the first may carry one-off
    work), in start order; every call launches the same kernels, so a call is len(events) / calls."""
    ordered = sorted(events, key=lambda e: e[1])
    n = len(ordered) // max(calls, 1)
    pick = ordered[n:2 * n] if calls > 1 else ordered
    return [[name[:120], round(dur / 1e3, 3)] for name, _, dur in pick]


def main(argv=None) -> int:
    args = parse(argv)
    from jaxspec.speculative.round import round_executable

    if args.fused_projections:  # before anything is traced
        from jaxspec.models import layers as model_layers

        model_layers.FUSED_KERNEL = True
    if args.gdn_chunk_from is not None:
        from pallas_kernels.gated_delta import recurrent

        recurrent.CHUNK_MIN_T = args.gdn_chunk_from
    name = common.shape_names(args.shapes, ("demo-qwen3.5",) if args.smoke else ("qwen3-4b",))[0]
    layers = common.parse_layers(args.layers, [name])[name]
    hf = common.shape_config(name, layers)
    model = common.build_model(hf, dtype=args.dtype, kernels=args.kernels, engine=args.engine)
    eng = model.engine(0)
    eng.caches = common.block(step_times._randomise(eng.caches, jax.random.PRNGKey(7)))
    cfg, ecfg, R, ks = model.config, eng.ecfg, args.batch, common.int_list(args.ks)
    _, inputs = step_times._batch_inputs(model, eng, R, ks, args.context)
    # every slot a step or a prefill call uses has its pages
    st = {"caches": eng.caches, "state": step_times.loop_state(eng, max([R] + args.rows_list), args.context)}
    weights = common.params_bytes_by_kind(cfg, args.dtype)
    itemsize = 2 if args.dtype == "bfloat16" else 4
    forward = jax.jit(functools.partial(_forward_argmax, cfg=cfg, ecfg=ecfg, kernels=eng.kernels),
                      donate_argnums=(1, 2))
    rng = np.random.default_rng(0)

    def forward_call(T):
        step_in = jax.device_put(dict(tokens=rng.integers(0, 1000, (R, T)).astype(np.int32),
                                      start_pos=np.full((R,), args.context, np.int32),
                                      num_valid=np.full((R,), T, np.int32), block_tables=step_times._tables(ecfg, R),
                                      seq_slot=np.arange(1, R + 1, dtype=np.int32)))

        def call():
            tokens, st["caches"], num_emitted = forward(model.params, st["caches"], st["state"].num_emitted, step_in)
            st["state"] = type(st["state"])(st["state"].last_token, st["state"].position, num_emitted,
                                             st["state"].block_tables, st["state"].sampling)
            return tokens
        return call

    def round_call(k, greedy=True, steps=1, drafter=None):
        """The engine's dispatch of `steps` rounds (k = 0: plain decode, with the model's inert
        columns unless `drafter` says otherwise); the loop state carries over."""
        dparams, dstate, rows, num_drafts, default = inputs[("verify", k) if k else ("decode", 0)]
        drafter = drafter or default
        fn = round_executable(cfg, ecfg, drafter, eng.kernels, greedy, steps)
        key = (k, greedy, steps, drafter)
        st[key] = dstate

        def call():
            emitted, _, st["caches"], st["state"], st[key] = fn(model.params, st["caches"], st["state"], dparams,
                                                               st[key], rows, num_drafts, None)
            return emitted
        return call, steps

    def prefill_call(C, rows):
        """The engine's prefill call of `rows` requests (slots 1..rows): C prompt tokens each after
        --context cached ones; the loop state carries over, so every call rewrites the same positions."""
        from jaxspec.engine import prefill_executable

        run = prefill_executable(cfg, ecfg, eng.kernels)
        tokens = jax.device_put(rng.integers(0, 1000, (rows, C)).astype(np.int32))
        meta = [jax.device_put(np.array(v, np.int32))
                for v in ([args.context] * rows, [C] * rows, list(range(1, rows + 1)))]

        def call():
            token, st["caches"], st["state"] = run(model.params, st["caches"], st["state"], tokens, *meta)
            return token
        return call, 1

    from jaxspec.speculative.drafters import NoDrafter

    pad = model.decode_pad
    plan = [(f"decode (engine round, greedy, {pad} inert)", 1, round_call(0)),
            (f"decode (engine round, sampling, {pad} inert)", 1, round_call(0, greedy=False)),
            (f"decode x4 rounds per dispatch ({pad} inert)", 1, round_call(0, steps=4)),
            ("decode T=1 (engine round, greedy, no inert column)", 1, round_call(0, drafter=NoDrafter(0))),
            ("forward+argmax T=1", 1, (forward_call(1), 1)),
            ("forward+argmax T=2", 2, (forward_call(2), 1))]
    for k in ks:
        plan.append((f"verify round k={k} T={1 + k}", 1 + k, round_call(k)))
        if 1 + k != 2:  # T = 2 is timed above
            plan.append((f"forward+argmax T={1 + k}", 1 + k, (forward_call(1 + k), 1)))
    if args.prefill_only:
        plan = []
    plan += [(f"prefill chunk C={C} x {rows} request{'s' * (rows > 1)}", (rows, C), prefill_call(C, rows))
             for C in args.chunk_list for rows in args.rows_list]
    plan = select_rows(plan, args.rows_re)
    res = common.Results("profile_step", args)  # after the check: a typo in --rows leaves earlier results alone
    bw = common.measure_bandwidth(4 * common.GiB if not args.smoke else common.GiB // 32)
    prefill = any(isinstance(T, tuple) for _, T, _ in plan)
    mm = common.measure_matmul(8192 if not args.smoke else 256) if prefill else None
    trace_root = args.trace_dir or tempfile.mkdtemp(prefix="jaxspec-profile-")
    budget = common.Budget(args.budget_s)
    for label, T, (call, steps) in plan:
        if not budget.allows():
            res.skip(label, "budget spent")
            continue
        try:
            item = profile(call, args, label, trace_root, steps)
        except Exception as e:
            res.error(label, e)
            continue
        if isinstance(T, tuple):  # a prefill call of rows x C tokens: bytes or FLOPs bound, whichever is slower
            rows, C = T
            flops = common.step_flops(cfg, weights, rows, C, args.context, itemsize=itemsize, last_only=True)
            item.update(tokens=rows * C, rows=rows, flops=flops, compute_floor_ms=flops / mm["flop_per_s"] * 1e3,
                        bytes_floor_ms=common.step_bytes(cfg, weights, rows, C, args.context, itemsize)["floor"]
                        / bw["bytes_per_s"] * 1e3)
            item["floor_ms"] = max(item["compute_floor_ms"], item["bytes_floor_ms"])
        else:
            item["floor_ms"] = common.step_bytes(cfg, weights, R, T, args.context, itemsize)["floor"] \
                / bw["bytes_per_s"] * 1e3
        res.add(item)
        log(f"{label}: pipelined {item['pipelined_ms']:.3f} ms, steady {item['steady_ms']:.3f} ms, dispatch "
            f"{item['dispatch_ms']:.3f} ms (idle device {item['dispatch_idle_ms']:.3f}), "
            f"device busy {fmt(item['device_busy_ms'], 3)} ms, "
            f"{item['kernels_per_step']:.0f} kernels")
    res.data.update(shape=name, layers=hf["num_hidden_layers"], batch=R, context=args.context, bandwidth=bw, matmul=mm,
                    kernels=eng.kernels, trace_dir=trace_root)
    res.finish()
    print_tables(res)
    return 0


def select_rows(plan: list, pattern: re.Pattern | None) -> list:
    """The plan rows whose label matches --rows; a pattern that matches none is a typo, not an empty run."""
    if pattern is None:
        return plan
    kept = [row for row in plan if pattern.search(row[0])]
    if not kept:
        labels = "\n  ".join(label for label, _, _ in plan)
        raise SystemExit(f"--rows {pattern.pattern!r} matches no step; the steps are:\n  {labels}")
    return kept


def print_tables(res) -> None:
    d = res.data
    rows = [[r["step"], fmt(r["pipelined_ms"], 3), fmt(r.get("steady_ms"), 3), fmt(r.get("dispatch_ms"), 3),
             fmt(r["latency_ms"], 3), fmt(r["device_busy_ms"], 3), fmt(r["floor_ms"], 3),
             f"{r['kernels_per_step']:.0f}"] for r in d["results"]]
    print(f"\n{d.get('shape')} ({d.get('layers')} layers), batch {d.get('batch')}, context {d.get('context')}, "
          f"kernels {d.get('kernels')}")
    print(common.format_table(rows, ["step", "pipelined ms", "steady ms", "dispatch ms", "latency ms",
                                     "device busy ms", "floor ms", "kernels"]))
    for r in d["results"]:
        print(f"\n{r['step']}: top kernels")
        print(common.format_table([[t["name"][:90], fmt(t["ms_per_step"], 4), fmt(t["calls_per_step"], 1)]
                                   for t in r["top"]], ["kernel", "ms/step", "calls/step"]))


if __name__ == "__main__":
    sys.exit(main())
