#!/usr/bin/env python
"""Step times (issue 7 a, b, e): the plain decode step (T = 1) and the speculative verify round
(T = 1+k) of the published shapes, timed through the engine's own executables at a realistic
context, against the physical floor; the verify fit verify(t) = a + b*t; the same verify run op by
op (jax.disable_jit) as the captured-vs-eager ratio; and memory per request (KV per token, GDN
state at each k) with the largest batch that fits the device.

Executables: decode = the round of the NoDrafter at (R, 1); verify = speculative.round.round_executable with
the replay drafter (a gather: the round is the verify forward plus the on-device rejection sampler)
at (R, 1+k). Both are lowered from the engine's own jitted functions, compiled in a thread pool and
called with the engine's caches (donated), randomised so no timing runs on zeros. Every row starts
at `--context` cached tokens. Floor = (weights touched + KV read/written + GDN state read and
snapshots written) / HBM bandwidth measured in the same run (common.step_bytes).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import functools  # noqa: E402
import gc  # noqa: E402
import importlib.metadata  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import common  # noqa: E402
from benchmarks.common import fmt, log  # noqa: E402

SMOKE = dict(shapes="demo-qwen3.5", batches="1", ks="1", context=24, repeats=3, pipeline=2, eager="none",
             bandwidth_gib=1 / 32, memory_lens="128,4096", compile_threads=2, warmup=1)


MOE_PATHS = ("gather", "grouped", "dense", "grouped-pallas")


def build_parser():
    p = common.parser(__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,8,4", help="request counts (each its own bucket), in priority order")
    p.add_argument("--ks", default="1,3,7,15", help="draft lengths k; the verify runs T = 1+k")
    p.add_argument("--context", type=int, default=512, help="tokens already cached in every row")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--kernels", default="auto", choices=["auto", "xla", "pallas"])
    p.add_argument("--eager", default="all", choices=["all", "first", "none"],
                   help="op-by-op verify (batch 1, --eager-k) on every shape, the first only, or none")
    p.add_argument("--eager-k", type=int, default=3)
    p.add_argument("--pipeline", type=int, default=8, help="calls per pipelined sample")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--compile-threads", type=int, default=common.default_threads())
    p.add_argument("--cache-dir", default="default",
                   help="persistent XLA cache ('default' = $JAXSPEC_CACHE_DIR or the user cache; 'none' = off)")
    p.add_argument("--bandwidth-gib", type=float, default=4.0, help="array size of the bandwidth reduction")
    p.add_argument("--memory-lens", default="4096,32768", help="max_model_len values of the memory table")
    p.add_argument("--device-memory-gb", type=float, default=None,
                   help="device memory for the max-batch table (default: the backend's bytes_limit, else 141)")
    p.add_argument("--reserve-gib", type=float, default=2.0, help="workspace kept free in the max-batch table")
    p.add_argument("--moe-paths", default=",".join(MOE_PATHS),
                   help="MoE shapes: expert paths timed alone on one layer at every step's token count "
                        "('none' = skip); grouped is XLA's ragged_dot, grouped-pallas the Pallas grouped kernel")
    return p


def parse(argv=None):
    p = build_parser()
    args = common.parse_args(p, argv, SMOKE)
    if args.moe_paths != "none":
        common.check_choices("--moe-paths", args.moe_paths, MOE_PATHS, "path")
    args.engine = common.engine_for_context(common.SMOKE_ENGINE if args.smoke else common.ENGINE, args.context)
    for name, values in (("--batches", common.int_list(args.batches)), ("--ks", common.int_list(args.ks))):
        if not values:
            raise SystemExit(f"{name} is empty")
    if max(common.int_list(args.batches)) > args.engine["max_num_seqs"]:
        raise SystemExit(f"--batches {args.batches}: at most max_num_seqs={args.engine['max_num_seqs']}")
    if max(common.int_list(args.ks)) > args.engine["max_num_speculative_tokens"]:
        raise SystemExit(f"--ks {args.ks}: at most k_max={args.engine['max_num_speculative_tokens']}")
    return args


# ------------------------------------------------------------------------------------------------
# Inputs: random caches, block tables, rows at `context`
# ------------------------------------------------------------------------------------------------


@functools.partial(jax.jit, donate_argnums=0)
def _randomise(caches, key):
    """Every cache buffer filled with random values (KV and conv ~ N(0, 1), GDN state ~ N(0, 0.1^2))."""
    leaves, tree = jax.tree_util.tree_flatten(caches)
    keys = jax.random.split(key, len(leaves))
    new = [(jax.random.normal(k, x.shape, jnp.float32) * (0.1 if x.dtype == jnp.float32 else 1.0)).astype(x.dtype)
           for k, x in zip(keys, leaves, strict=True)]
    return jax.tree_util.tree_unflatten(tree, new)


def _tables(ecfg, R: int) -> np.ndarray:
    """Rows 0..R-1 are engine slots 1..R, each owning a contiguous run of pages (page 0 is null)."""
    P = ecfg.pages_per_seq
    return (1 + np.arange(R)[:, None] * P + np.arange(P)[None, :]).astype(np.int32)


def loop_state(eng, R: int, context: int, seed: int = 0):
    """The engine's loop state with rows 1..R at `context` cached tokens, each owning a contiguous
    run of pages, random last tokens, greedy sampling (a host build + one transfer)."""
    from jaxspec.engine import LoopState
    from jaxspec.sharding import put

    ecfg, rng, mesh = eng.ecfg, np.random.default_rng(seed), eng.mesh
    n = ecfg.max_num_seqs + 1
    tables = np.zeros((n, ecfg.pages_per_seq), np.int32)
    tables[1:R + 1] = _tables(ecfg, R)
    last = np.zeros((n,), np.int32)
    last[1:R + 1] = rng.integers(0, min(eng.cfg.vocab_size, 32000), (R,))
    position = np.zeros((n,), np.int32)
    position[1:R + 1] = context
    s = eng.state
    return LoopState(last_token=put(last, mesh), position=put(position, mesh),
                     num_emitted=put(np.ones((n,), np.int32), mesh), block_tables=put(tables, mesh),
                     sampling=s.sampling)


def _batch_inputs(model, eng, R: int, ks: list[int], context: int, steps: int = 1):
    """({("decode", 0) | ("verify", k): a function returning the Lowered executable}, call inputs):
    rows in slots 1..R at `context` cached tokens, greedy; decode is the round of the NoDrafter,
    verify the replay drafter's round (random references, alpha 0.5). The loop state advances by
    the emitted tokens on every call, as in serving (a few hundred positions over a timing run)."""
    from jaxspec.sharding import put
    from jaxspec.speculative.round import round_executable
    from jaxspec.speculative.session import make_drafter

    cfg, ecfg, rng, mesh = model.config, eng.ecfg, np.random.default_rng(R), model.config.mesh
    vocab = min(cfg.vocab_size, 32000)
    rows = put(np.arange(1, R + 1, dtype=np.int32), mesh)
    makers, inputs = {}, {}
    for k in [0] + list(ks):
        # decode: the engine's plain step, with its inert columns (Model.decode_pad) on a GPU
        drafter = make_drafter("replay", model, ecfg, k) if k else make_drafter(None, model, ecfg, model.decode_pad)
        dparams = dstate = None
        if k:
            S = ecfg.max_num_seqs + 1
            dstate = put({"ref": rng.integers(0, vocab, (S, drafter.ref_len)).astype(np.int32),
                          "length": np.full((S,), drafter.ref_len, np.int32),
                          "generated": np.zeros((S,), np.int32)}, mesh)
            dparams = put({"alpha": np.float32(0.5), "seed": np.uint32(0)}, mesh)
        fn = round_executable(cfg, ecfg, drafter, eng.kernels, True, steps)
        num_drafts = put(np.int32(k), mesh)
        key = ("verify", k) if k else ("decode", 0)
        makers[key] = functools.partial(fn.lower, model.params, eng.caches, eng.state, dparams, dstate, rows,
                                        num_drafts, None)
        inputs[key] = (dparams, dstate, rows, num_drafts, drafter)
    return makers, inputs


def _caller(key, exe, model, st: dict, inputs):
    """A zero-argument dispatch threading the donated caches / loop state / drafter state through st."""
    params = model.params
    dparams, _, rows, num_drafts, _ = inputs
    k = key[1]

    def call():
        emitted, _, st["caches"], st["state"], st["dstate"][k] = exe(params, st["caches"], st["state"], dparams,
                                                                     st["dstate"][k], rows, num_drafts, None)
        return emitted
    return call


# ------------------------------------------------------------------------------------------------
# One batch, the eager comparison, the memory table
# ------------------------------------------------------------------------------------------------


def fit_line(ts, ys) -> dict | None:
    """Least squares y = a + b t; None with fewer than two points."""
    if len(ts) < 2:
        return None
    b, a = np.polyfit(np.asarray(ts, float), np.asarray(ys, float), 1)
    pred = a + b * np.asarray(ts, float)
    ss = float(np.sum((np.asarray(ys) - np.mean(ys)) ** 2))
    r2 = 1.0 - float(np.sum((np.asarray(ys) - pred) ** 2)) / ss if ss > 0 else 1.0
    return {"a_ms": float(a), "b_ms_per_token": float(b), "r2": r2, "points": len(ts)}


def _renew_state(model, eng, st: dict) -> None:
    """Fresh random caches and num_accepted where a failed call left deleted (donated) buffers."""
    from jaxspec import cache

    if any(x.is_deleted() for x in jax.tree_util.tree_leaves(st["caches"])):
        st["caches"] = _randomise(cache.allocate(model.config, eng.ecfg, model.dtype), jax.random.PRNGKey(8))
    if any(x.is_deleted() for x in jax.tree_util.tree_leaves(st["state"])):
        st["state"] = loop_state(eng, st["R"], st["context"])
    for k, d in list(st["dstate"].items()):
        if any(x.is_deleted() for x in jax.tree_util.tree_leaves(d)):
            st["dstate"].pop(k)


def run_batch(model, eng, R: int, args, weights: dict, bandwidth: float) -> dict:
    ks = common.int_list(args.ks)
    t0 = time.perf_counter()
    makers, inputs = _batch_inputs(model, eng, R, ks, args.context)
    compiled, errors, lower_s, compile_wall = common.lower_and_compile(makers, args.compile_threads)
    lower_total = sum(lower_s.values())
    log(f"  R={R}: {len(compiled)} executables lowered ({lower_total:.1f}s) and compiled "
        f"({args.compile_threads} threads) in {compile_wall:.1f}s" + (f"; {len(errors)} failed" if errors else ""))
    eng.state = loop_state(eng, R, args.context)
    st = {"caches": eng.caches, "state": eng.state, "R": R, "context": args.context,
          "dstate": {k: inputs[key][1] for key in inputs for k in [key[1]]}}
    items = []
    for key in [("decode", 0)] + [("verify", k) for k in ks]:
        kind, k = key
        T = 1 + k
        item = {"kind": kind, "k": k, "T": T, "lower_s": round(lower_s.get(key, 0.0), 3)}
        if key in errors:
            item["error"] = errors[key]
            items.append(item)
            continue
        try:
            timing = common.time_steps(_caller(key, compiled[key], model, st, inputs[key]), warmup=args.warmup,
                                       repeats=args.repeats, pipeline=args.pipeline)
        except Exception as e:  # a failing executable may have consumed the donated caches: renew them
            item["error"] = f"run: {type(e).__name__}: {e}"[:2000]
            items.append(item)
            log(f"  R={R} {kind} T={T}: {item['error'][:200]}")
            _renew_state(model, eng, st)
            continue
        b = common.step_bytes(model.config, weights, R, T, args.context, np.dtype(model.dtype).itemsize)
        floor_ms = b["floor"] / bandwidth * 1e3
        item.update(timing=timing, bytes=b, floor_ms=floor_ms,
                    pipelined_ms=timing["pipelined"]["median_ms"] if timing["pipelined"] else None,
                    latency_ms=timing["latency"]["median_ms"])
        item["ratio_to_floor"] = (item["pipelined_ms"] or item["latency_ms"]) / floor_ms
        items.append(item)
        log(f"  R={R} {kind:6s} T={T:2d}: pipelined {fmt(item['pipelined_ms'], 3)} ms, latency "
            f"{item['latency_ms']:.3f} ms, floor {floor_ms:.3f} ms, x{item['ratio_to_floor']:.2f}")
    eng.caches, eng.state = st["caches"], st["state"]
    ok = [i for i in items if "error" not in i]
    fits = {}
    for mode in ("pipelined_ms", "latency_ms"):
        pts = [(i["T"], i[mode]) for i in ok if i.get(mode) is not None]
        fits[mode] = fit_line([t for t, _ in pts], [y for _, y in pts])
        vpts = [(t, y) for t, y in pts if t > 1]
        fits[mode + "_verify_only"] = fit_line([t for t, _ in vpts], [y for _, y in vpts])
    floor_fit = fit_line([i["T"] for i in ok], [i["floor_ms"] for i in ok])
    return {"R": R, "context": args.context, "items": items, "fit": fits, "floor_fit": floor_fit,
            "lower_s": round(lower_total, 2), "lower_and_compile_wall_s": round(compile_wall, 2),
            "wall_s": round(time.perf_counter() - t0, 2)}


def run_eager(model, eng, args, captured_ms: float | None) -> dict:
    """The verify round at batch 1, k = --eager-k, op by op (jax.disable_jit): the 'graph off' A/B."""
    from jaxspec.speculative.round import one_round

    k = args.eager_k
    _, inputs = _batch_inputs(model, eng, 1, [k], args.context)
    dparams, dstate, rows, num_drafts, drafter = inputs[("verify", k)]
    fn = functools.partial(one_round, cfg=model.config, ecfg=eng.ecfg, drafter=drafter, kernels=eng.kernels,
                           greedy=True)
    st = {"caches": eng.caches, "state": loop_state(eng, 1, args.context), "dstate": dstate}

    def call():
        emitted, _, st["caches"], st["state"], st["dstate"] = fn(model.params, st["caches"], st["state"], dparams,
                                                                 st["dstate"], rows, num_drafts, None)
        return emitted

    cache_on = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)  # thousands of one-op executables: keep them off disk
    try:
        with jax.disable_jit():
            timing = common.time_steps(call, warmup=1, repeats=max(3, min(args.repeats, 5)), pipeline=0)
    finally:
        jax.config.update("jax_enable_compilation_cache", cache_on)
    eng.caches, eng.state = st["caches"], st["state"]
    eager_ms = timing["latency"]["median_ms"]
    return {"R": 1, "k": k, "T": 1 + k, "eager_latency_ms": eager_ms, "captured_latency_ms": captured_ms,
            "eager_over_captured": eager_ms / captured_ms if captured_ms else None, "timing": timing,
            "note": "op by op under jax.disable_jit (no donation: functional cache updates copy the pools)"}


def _physical_gpu_bytes() -> int | None:
    """The GPU's total memory from nvidia-smi (the backend's bytes_limit is only JAX's share of it)."""
    text = common.run_command(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"])
    try:
        return int(text.splitlines()[0]) * 2**20 if text else None
    except ValueError:
        return None


def memory_table(name: str, args) -> dict:
    """Per-request KV / GDN / conv bytes (full-depth config) and the largest batch that fits."""
    from jaxspec.cache import cache_bytes, device_memory_bytes
    from jaxspec.config import EngineConfig
    from jaxspec.loader import DTYPES

    cfg = common.model_config(common.shape_config(name))
    weights = sum(common.params_bytes_by_kind(cfg, args.dtype).values())
    if args.device_memory_gb:
        device, source = int(args.device_memory_gb * 1e9), "--device-memory-gb"
    elif device_memory_bytes():
        device, source = device_memory_bytes(), "backend bytes_limit (XLA_PYTHON_CLIENT_MEM_FRACTION of the GPU)"
    else:
        device, source = int(141e9), "nominal H200 141 GB (this backend reports no limit)"
    reserve = int(args.reserve_gib * common.GiB)
    dtype = DTYPES[args.dtype]
    rows = []
    for L in common.int_list(args.memory_lens):
        for k in (0, 1, 3, 7, 15):
            sizes = [cache_bytes(cfg, EngineConfig(max_num_seqs=s, max_model_len=L, max_num_speculative_tokens=k,
                                                   page_size=args.engine["page_size"]), dtype) for s in (1, 2)]
            per = {c: sizes[1][c] - sizes[0][c] for c in sizes[0]}
            per_request = sum(per.values())
            free = device - weights - reserve
            rows.append({"max_model_len": L, "k": k, "per_request_bytes": per, "per_request_total": per_request,
                         "max_batch": max(0, free // per_request) if per_request else None})
    physical = _physical_gpu_bytes()
    for r in rows:
        fits = physical and r["per_request_total"]
        r["max_batch_physical"] = max(0, (physical - weights - reserve) // r["per_request_total"]) if fits else None
    itemsize = np.dtype(dtype).itemsize
    return {"weights_bytes": weights, "device_bytes": device, "device_source": source, "reserve_bytes": reserve,
            "physical_bytes": physical,
            "kv_bytes_per_token": 2 * len(cfg.attention_layers) * cfg.num_key_value_heads * cfg.head_dim * itemsize,
            "gdn_state_bytes_per_slot": len(cfg.gdn_layers) * cfg.linear_num_value_heads * cfg.linear_key_head_dim
            * cfg.linear_value_head_dim * 4, "rows": rows}


# ------------------------------------------------------------------------------------------------
# MoE: the expert matmuls of one layer, path by path, against the union of the chosen experts
# ------------------------------------------------------------------------------------------------


def _random_routing(n: int, cfg, dtype, seed: int):
    """x [n, H] ~ N(0, 1), top_i [n, k]: k distinct experts per token uniformly at random (the floor
    model's routing), top_w [n, k] normalised."""
    rng = np.random.default_rng(seed)
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    top_i = np.argsort(rng.random((n, E)), axis=1)[:, :k].astype(np.int32)
    top_w = rng.random((n, k))
    top_w /= top_w.sum(axis=1, keepdims=True)
    x = rng.standard_normal((n, cfg.hidden_size))
    return jnp.asarray(x, dtype), jnp.asarray(top_w, dtype), jnp.asarray(top_i), len(np.unique(top_i))


def _lower_moe(path: str, p, args_):
    """Lowered jit of one expert path; grouped-pallas is the grouped path through the Pallas kernel."""
    from jaxspec.models import layers

    name, _, impl = path.partition("-")
    return jax.jit(functools.partial(layers.EXPERT_PATHS[name], kernels=impl or "xla")).lower(p, *args_)


def _hlo_facts(exe) -> dict:
    """What the backend made of the path: its custom-call targets (a cuDNN ragged-dot fusion shows
    here) and whether a ragged-dot survived to the optimised HLO (else it was rewritten, e.g. to a
    padded dense dot)."""
    try:
        text = exe.as_text()
    except Exception as e:
        return {"hlo": f"unavailable: {type(e).__name__}"}
    return {"custom_calls": sorted(set(re.findall(r'custom_call_target="([^"]+)"', text))),
            "ragged_dot_in_hlo": "ragged-dot(" in text, "dots_in_hlo": len(re.findall(r" dot\(", text))}


def _time_moe(exe, inputs: tuple, args) -> dict:
    """{timing, ms} of a compiled expert path, or {error}."""
    try:
        t = common.time_steps(lambda: exe(*inputs), warmup=args.warmup, repeats=args.repeats,
                              pipeline=args.pipeline)
    except Exception as e:
        return {"error": f"run: {type(e).__name__}: {e}"[:2000]}
    return {"timing": t, "ms": (t["pipelined"] or t["latency"])["median_ms"]}


def run_moe_paths(model, args, bandwidth: float, kernels: str) -> dict:
    """One MoE layer's routed experts (router and shared expert excluded), random routing, at the
    token count of every timed step, by each path in --moe-paths. Floor: the weights of the experts
    the sampled routing chose (their union, each read once) plus x read and the output written.
    kernels: the engine's ("xla" / "pallas"), which decides the path layers.moe picks (auto)."""
    from jaxspec.models import layers

    cfg = model.config
    p = next(layer["moe"] for layer in model.params["layers"] if "moe" in layer)
    p = {k: p[k] for k in ("gate", "up", "down")}
    expert_bytes = sum(int(np.prod(p[k].shape[1:])) * p[k].dtype.itemsize for k in p)
    ns = sorted({R * T for R in common.int_list(args.batches) for T in [1] + [1 + k for k in common.int_list(args.ks)]})
    paths = args.moe_paths.split(",")
    inputs = {n: _random_routing(n, cfg, model.dtype, seed=n) for n in ns}
    makers = {(n, path): functools.partial(_lower_moe, path, p, inputs[n][:3]) for n in ns for path in paths}
    compiled, errors, _, wall = common.lower_and_compile(makers, args.compile_threads)
    rows = []
    for n in ns:
        x, top_w, top_i, distinct = inputs[n]
        floor_bytes = distinct * expert_bytes + 2 * x.size * x.dtype.itemsize
        for path in paths:
            row = {"N": n, "pairs": n * cfg.num_experts_per_tok, "path": path, "distinct_experts": distinct,
                   "expected_experts": round(common.expected_experts(cfg, n), 2),
                   "auto": layers.moe_path(n, cfg.num_experts, cfg.num_experts_per_tok, kernels)
                   + ("-pallas" if kernels == "pallas" else ""),
                   "floor_ms": floor_bytes / bandwidth * 1e3}
            if (n, path) in errors:
                row["error"] = errors[(n, path)]
            else:
                row.update(_hlo_facts(compiled[(n, path)]))
                row.update(_time_moe(compiled[(n, path)], (p, x, top_w, top_i), args))
            if "ms" in row:
                row["ratio_to_floor"] = row["ms"] / row["floor_ms"]
            rows.append(row)
            log(f"  moe N={n:3d} {path:14s}: " + (f"{row['ms']:.3f} ms, floor {row['floor_ms']:.3f} ms, "
                f"x{row['ratio_to_floor']:.2f}" if "ms" in row else row["error"][:160]))
    return {"expert_bytes": expert_bytes, "compile_wall_s": round(wall, 2), "rows": rows,
            "cudnn": {d: _installed(d) for d in ("nvidia-cudnn-cu13", "nvidia-cudnn-cu12")}}


def _installed(package: str) -> str | None:
    """Version of an installed distribution (XLA lowers ragged_dot to cuDNN only from cuDNN 9.22)."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


# ------------------------------------------------------------------------------------------------
# Driver
# ------------------------------------------------------------------------------------------------


def run_shape(name: str, layers: int | None, args, res, bandwidth: float, budget, deadline: float,
              first: bool) -> None:
    hf = common.shape_config(name, layers)
    rec = res.add({"shape": name, "layers": hf["num_hidden_layers"],
                   "full_layers": common.shape_config(name)["num_hidden_layers"], "batches": []})
    rec["memory"] = memory_table(name, args)
    t0 = time.perf_counter()
    model = common.build_model(hf, dtype=args.dtype, kernels=args.kernels, engine=args.engine)
    eng = model.engine(0)
    eng.caches = common.block(_randomise(eng.caches, jax.random.PRNGKey(7)))
    rec.update(init_s=round(time.perf_counter() - t0, 2), kernels=eng.kernels, engine=vars(eng.ecfg),
               weights_bytes_by_kind=common.params_bytes_by_kind(model.config, args.dtype))
    log(f"{name}: {rec['layers']}/{rec['full_layers']} layers, kernels={eng.kernels}, built in {rec['init_s']}s")
    res.save()
    weights = rec["weights_bytes_by_kind"]
    last_cost = 0.0
    for R in common.int_list(args.batches):
        if rec["batches"] and time.perf_counter() + last_cost > deadline:
            res.skip(f"{name} R={R}", f"shape share of the budget spent (last batch took {last_cost:.0f}s)")
            continue
        try:
            t1 = time.perf_counter()
            rec["batches"].append(run_batch(model, eng, R, args, weights, bandwidth))
            last_cost = time.perf_counter() - t1
        except Exception as e:
            res.error(f"{name} R={R}", e)
        res.save()
    if model.config.num_experts and args.moe_paths != "none" and budget.allows():
        try:
            rec["moe_paths"] = run_moe_paths(model, args, bandwidth, eng.kernels)
        except Exception as e:
            res.error(f"{name} moe paths", e)
        res.save()
    want_eager = args.eager == "all" or (args.eager == "first" and first)
    if want_eager and budget.allows(30 if not args.smoke else 0):
        captured = next((i["latency_ms"] for b in rec["batches"] if b["R"] == 1 for i in b["items"]
                         if i["kind"] == "verify" and i["k"] == args.eager_k and "error" not in i), None)
        try:
            rec["eager"] = run_eager(model, eng, args, captured)
            log(f"  eager verify R=1 k={args.eager_k}: {rec['eager']['eager_latency_ms']:.1f} ms "
                f"(captured {fmt(captured, 3)} ms)")
        except Exception as e:
            res.error(f"{name} eager", e)
    elif want_eager:
        res.skip(f"{name} eager", "budget")
    res.save()
    del model, eng
    gc.collect()


def print_tables(res) -> None:
    rows, fits, eager, mem, moe = [], [], [], [], []
    for rec in res.data["results"]:
        label = f"{rec['shape']}" + (f"[{rec['layers']}L]" if rec["layers"] != rec["full_layers"] else "")
        for b in rec["batches"]:
            for i in b["items"]:
                if "error" in i:
                    rows.append([label, b["R"], i["kind"], i["T"], "ERROR", "", "", "", ""])
                    continue
                experts = i["bytes"].get("experts_per_layer")
                rows.append([label, b["R"], i["kind"], i["T"], fmt(i["pipelined_ms"], 3), fmt(i["latency_ms"], 3),
                             fmt(i["floor_ms"], 3), fmt(i["ratio_to_floor"]), fmt(experts or None, 1)])
            f, ff = b["fit"]["pipelined_ms"], b["floor_fit"]
            if f:
                fits.append([label, b["R"], f"{f['a_ms']:.3f} {f['b_ms_per_token']:+.3f} t", fmt(f["r2"], 3),
                             f"{ff['a_ms']:.3f} {ff['b_ms_per_token']:+.3f} t" if ff else "-"])
        if rec.get("eager"):
            e = rec["eager"]
            eager.append([label, e["T"], fmt(e["eager_latency_ms"], 1), fmt(e["captured_latency_ms"], 3),
                          fmt(e["eager_over_captured"], 1)])
        for r in (rec.get("moe_paths") or {}).get("rows", []):
            moe.append([label, r["N"], r["pairs"], r["distinct_experts"], r["path"] + (" *" if r["path"] == r["auto"]
                        else ""), fmt(r.get("ms"), 3) if "error" not in r else "ERROR", fmt(r["floor_ms"], 3),
                        fmt(r.get("ratio_to_floor"))])
        m = rec.get("memory")
        if m:
            for r in m["rows"]:
                if r["k"] in (0, 3, 15):
                    mem.append([rec["shape"], r["max_model_len"], r["k"], f"{r['per_request_total'] / 2**20:.1f}",
                                r["max_batch"], r.get("max_batch_physical") or "-"])
    print("\nstep times (ms; pipelined = back-to-back calls, latency = each call waited for)")
    print(common.format_table(rows, ["shape", "R", "step", "T", "pipelined", "latency", "floor", "x floor",
                                     "experts/layer"]))
    if moe:
        print("\nMoE routed experts, one layer, random routing (ms; * = the path layers.moe picks; floor = the "
              "chosen experts' weights once)")
        print(common.format_table(moe, ["shape", "N", "pairs", "experts", "path", "ms", "floor", "x floor"]))
    if fits:
        print("\nverify(t) fit, pipelined (ms)  vs  floor(t)")
        print(common.format_table(fits, ["shape", "R", "fit", "r2", "floor fit"]))
    if eager:
        print("\ncaptured vs eager verify (batch 1)")
        print(common.format_table(eager, ["shape", "T", "eager ms", "captured ms", "eager/captured"]))
    if mem:
        print("\nmemory per request (full depth) and largest batch that fits")
        print(common.format_table(mem, ["shape", "max_model_len", "k", "MiB/request", "max batch (JAX limit)",
                                        "max batch (whole GPU)"]))


def main(argv=None) -> int:
    args = parse(argv)
    names = common.shape_names(args.shapes, ("demo-qwen3.5",) if args.smoke else common.DEFAULT_SHAPES)
    layers = common.parse_layers(args.layers, names)
    budget = common.Budget(args.budget_s)
    res = common.Results("step_times", args)
    res.data["cache_dir"] = common.setup_jax(args.cache_dir)
    bw = common.measure_bandwidth(int(args.bandwidth_gib * common.GiB))
    res.data["bandwidth"] = bw
    log(f"HBM read bandwidth {bw['tb_per_s']:.3f} TB/s ({bw['bytes'] / 2**30:.2f} GiB reduction)")
    for n, name in enumerate(names):
        if not budget.allows():
            res.skip(name, "budget spent")
            continue
        deadline = time.perf_counter() + (budget.left() / (len(names) - n) if math.isfinite(budget.left()) else 1e9)
        try:
            run_shape(name, layers[name], args, res, bw["bytes_per_s"], budget, deadline, first=n == 0)
        except Exception as e:
            res.error(name, e)
        gc.collect()
    res.finish()
    print_tables(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
