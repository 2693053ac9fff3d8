#!/usr/bin/env python
"""End-to-end tokens/s (issue 7 c): plain greedy vs speculative through `jaxspec.generate`, paired
in one process on the same model, prompts and engine; compile excluded (every executable is
compiled ahead in a thread pool into the persistent cache, then every configuration is warmed up
once); median of --repeats.

Drafters: replay (the target's own greedy continuation, each token corrupted with probability
1 - alpha: a controlled acceptance rate), ngram (prompt lookup), draft_model (a --draft-layers
model of the same shape family), and the tap drafters eagle3 (one draft layer of the target's layer
shape over three taps, a draft vocabulary of min(32000, V)) and dflash (--dflash-layers layers of the
target's layer shape, block 16) at k = --head-k, written in their published checkpoint layouts and
loaded back. Drafters other than replay have random weights, so their acceptance is near zero
(reported anyway): they are here for their cost, c below.
Per configuration: tau (bonus included) against E[tau] = (1 - a^(k+1)) / (1 - a) for replay, the
decode speedup over plain, and two models: model_speedup = tau * t_decode / t_round = tau / (1 +
c_round) with c_round = t_round / t_decode - 1 (jaxspec.measure's c: everything a round costs beyond
a decode step), and model_speedup_simple = tau / (1 + c) with c = drafter cost / verify cost, where
verify cost = the replay round at the same k (its drafter is a gather) and drafter cost =
round(method) - round(replay); the simple model assumes a verify costs a decode step
(verify_over_decode says how far that is off). Decode time = run time minus the prefill time
measured with max_new_tokens=1; t_round and t_decode = decode time / rounds (steps).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import functools  # noqa: E402
import gc  # noqa: E402
import math  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

from benchmarks import common  # noqa: E402
from benchmarks.common import fmt, log  # noqa: E402

SMOKE = dict(shapes="demo-qwen3.5", batch=1, prompt_len=20, new_tokens=12, alphas="0.8", ks="1", ngram_k=1,
             draft_k=1, draft_layers=2, repeats=1, compile_threads=2, methods="replay,ngram,draft_model,eagle3,dflash",
             head_k=1, dflash_layers=1)
METHODS = ("replay", "ngram", "draft_model", "eagle3", "dflash")
DEFAULT_METHODS = ("replay", "ngram", "draft_model")
TAP_METHODS = ("eagle3", "dflash")


def parse(argv=None):
    p = common.parser(__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=1, help="prompts per generate call (Spec-Bench: 1)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128, help="tokens generated per prompt (no EOS: exact)")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS), help=f"comma list of {', '.join(METHODS)}")
    p.add_argument("--alphas", default="0.6,0.8,0.9", help="replay acceptance rates")
    p.add_argument("--ks", default="3,7", help="replay draft lengths")
    p.add_argument("--ngram-k", type=int, default=3)
    p.add_argument("--draft-k", type=int, default=3)
    p.add_argument("--draft-layers", type=int, default=4, help="decoder layers of the draft model")
    p.add_argument("--head-k", type=int, default=3, help="draft length of eagle3 and dflash (c needs replay at it)")
    p.add_argument("--dflash-layers", type=int, default=5, help="layers of the random DFlash drafter")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--kernels", default="auto", choices=["auto", "xla", "pallas"])
    p.add_argument("--compile-threads", type=int, default=common.default_threads())
    p.add_argument("--cache-dir", default="default",
                   help="persistent XLA cache ('default' = $JAXSPEC_CACHE_DIR or the user cache; 'none' = off)")
    p.add_argument("--rounds-per-dispatch", type=int, default=1, help="the loop's rounds per executable call")
    p.add_argument("--dispatch-ahead", type=int, default=1, help="calls enqueued before a read-back (0 = sync)")
    p.set_defaults(repeats=3)
    args = common.parse_args(p, argv, SMOKE)
    args.engine = dict(common.SMOKE_ENGINE if args.smoke else common.ENGINE,
                       rounds_per_dispatch=args.rounds_per_dispatch, dispatch_ahead=args.dispatch_ahead)
    common.check_choices("--methods", args.methods, METHODS, "method")
    if args.prompt_len + args.new_tokens + 16 > args.engine["max_model_len"]:
        raise SystemExit(f"--prompt-len + --new-tokens must stay under max_model_len={args.engine['max_model_len']}")
    kmax = max(common.int_list(args.ks) + [args.ngram_k, args.draft_k, args.head_k])
    if kmax > args.engine["max_num_speculative_tokens"] or not 1 <= args.batch <= args.engine["max_num_seqs"]:
        raise SystemExit(f"k <= {args.engine['max_num_speculative_tokens']} and 1 <= --batch <= "
                         f"{args.engine['max_num_seqs']} (the engine settings shared with step_times)")
    return args


def _configs(args) -> list[dict]:
    methods = args.methods.split(",")
    out = []
    if "replay" in methods:
        out += [{"method": "replay", "k": k, "alpha": a} for k in common.int_list(args.ks)
                for a in common.float_list(args.alphas)]
    if "ngram" in methods:
        out.append({"method": "ngram", "k": args.ngram_k})
    if "draft_model" in methods:
        out.append({"method": "draft_model", "k": args.draft_k})
    out += [{"method": m, "k": args.head_k} for m in TAP_METHODS if m in methods]
    return out


def random_tap_heads(model, methods, dflash_layers: int, directory, seed: int = 2) -> dict:
    """{method: path} of random EAGLE-3 / DFlash drafters for the target `model`, written in their
    published checkpoint layouts (bf16) under `directory`: draft layers of the target's own layer
    shape (heads, KV heads, head dim, MLP width), the taps of tools/train_heads.py, EAGLE-3's draft
    vocabulary the first min(32000, V) ids, DFlash's mask token the last id."""
    import jax
    import numpy as np

    sys.path.insert(0, str(common.REPO / "tools"))  # the heads' initialisers of tools/train_heads.py
    import train_heads

    from jaxspec.speculative import dflash, eagle3

    cfg = model.config
    size = dict(heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                inter=cfg.intermediate_size, draft_vocab=min(32000, cfg.vocab_size), layers=dflash_layers)
    params = {k: model.params[k].astype("float32") for k in ("norm", "embed", "lm_head") if k in model.params}
    key = jax.random.PRNGKey(seed)
    out = {}
    if "eagle3" in methods:
        ecfg = train_heads.eagle3_config(cfg, size)
        kept = np.arange(size["draft_vocab"], dtype=np.int32)
        head = train_heads.eagle3_head(train_heads.init_eagle3(key, ecfg, params, cfg, kept), kept)
        out["eagle3"] = eagle3.save(head, ecfg, Path(directory) / "eagle3", dtype="bfloat16")
    if "dflash" in methods:
        dcfg = train_heads.dflash_config(cfg, size, mask_token_id=cfg.vocab_size - 1)
        out["dflash"] = dflash.save(train_heads.init_dflash(key, dcfg, params, cfg), dcfg, Path(directory) / "dflash",
                                    dtype="bfloat16")
    return out


def precompile(model, draft, configs, batch: int, threads: int) -> dict:
    """Every executable the runs use, lowered here and compiled in a thread pool into the persistent
    cache; the generate calls then load them instead of compiling (jaxspec precompile, in parallel)."""
    from jaxspec.compile import Bucket, lower_bucket

    K = model.max_num_speculative_tokens
    R = model.engine_config(K).request_bucket(batch)
    S = model.rounds_per_dispatch
    table = [Bucket("allocate", 0, 0, K), Bucket("set_sampling", 1, 0, K), Bucket("prefill", 1, model.prefill_chunk, K),
             Bucket("decode", R, 1 + model.decode_pad, K, sampling="greedy", steps=S)]
    for c in configs:
        m, k = c["method"], c["k"]
        if m in TAP_METHODS:  # their executables compile in the warm-up call
            continue
        table.append(Bucket(f"verify[{m}]", R, 1 + k, K, k, m, "greedy", S))
        if m == "draft_model":
            table += [Bucket("draft_allocate", 0, 0, k, k, m), Bucket("draft_prefill", 1, draft.prefill_chunk, k, k, m)]
        else:
            table.append(Bucket(f"admit[{m}]", 1, 0, K, k, m))
    table = list(dict.fromkeys(table))
    makers = {b: functools.partial(lower_bucket, model, b, draft) for b in table}
    _, errors, lower_s, wall = common.lower_and_compile(makers, threads)
    return {"executables": len(table), "lower_s": round(sum(lower_s.values()), 2), "wall_s": round(wall, 2),
            "errors": {f"{b.name} {b.describe()}": e for b, e in errors.items()}}


def _run(model, prompts, n: int, spec, repeats: int) -> dict:
    """One warm-up call, then `repeats` timed calls; the median run's numbers."""
    import jaxspec

    jaxspec.generate(model, prompts, max_new_tokens=min(n, 8), speculative=spec)  # warm (loads executables)
    runs = [jaxspec.generate(model, prompts, max_new_tokens=n, speculative=spec) for _ in range(repeats)]
    seconds = [r.stats.seconds for r in runs]
    mid = sorted(range(len(runs)), key=lambda i: seconds[i])[len(runs) // 2]
    r = runs[mid]
    s = r.stats
    return {"seconds": s.seconds, "seconds_all": seconds, "tokens": s.tokens, "steps": s.steps, "tau": s.tau,
            "acceptance_rate": s.acceptance_rate, "acceptance_by_position": s.acceptance_by_position,
            "emitted_histogram": s.emitted_histogram, "token_ids": r.token_ids}


def _replay_reference(model, prompts, n: int, plain: list, configs: list) -> tuple[list, dict]:
    """The replay drafter's reference: the speculative path's own greedy continuation. In bf16 the
    verify over 1 + k tokens rounds differently from a one-token step, so greedy speculation parts
    from plain decoding within a few dozen tokens; a reference taken from plain decoding is then
    wrong from there on and tau collapses towards 1. Replay at alpha 1 (largest k) with the current
    reference is run until its output is the reference (a fixed point), at most 5 times."""
    import jaxspec

    ks = [c["k"] for c in configs if c["method"] == "replay"]
    if not ks:
        return plain, {}
    ref, k = plain, max(ks)
    for i in range(1, 6):
        spec = jaxspec.SpeculativeConfig("replay", k, replay_tokens=ref, replay_alpha=1.0)
        out = jaxspec.generate(model, prompts, max_new_tokens=n, speculative=spec).token_ids
        if out == ref:
            return ref, {"k": k, "iterations": i, "fixed_point": True, **_parity(ref, plain)}
        ref = out
    return ref, {"k": k, "iterations": 5, "fixed_point": False, **_parity(ref, plain)}


def _parity(token_ids, reference) -> dict:
    same = [a == b for a, b in zip(token_ids, reference, strict=True)]
    first = [next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
             for a, b in zip(token_ids, reference, strict=True)]
    return {"identical_fraction": sum(same) / len(same), "first_divergence": first}


def run_shape(name: str, layers, args, res, budget) -> None:
    from jaxspec.speculative.config import SpeculativeConfig

    hf = common.shape_config(name, layers)
    rec = res.add({"shape": name, "layers": hf["num_hidden_layers"],
                   "full_layers": common.shape_config(name)["num_hidden_layers"], "batch": args.batch,
                   "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "runs": []})
    t0 = time.perf_counter()
    model = common.build_model(hf, dtype=args.dtype, kernels=args.kernels, engine=args.engine)
    configs = _configs(args)
    draft = None
    if any(c["method"] == "draft_model" for c in configs):
        draft = common.build_model(common.shape_config(name, args.draft_layers), dtype=args.dtype,
                                   kernels=args.kernels, seed=1, engine=args.engine)
        rec["draft_layers"] = args.draft_layers
        rec["draft_note"] = "random weights: target and draft disagree, acceptance near zero by construction"
    heads_dir = None
    if any(c["method"] in TAP_METHODS for c in configs):
        heads_dir = tempfile.TemporaryDirectory(prefix="jaxspec-e2e-heads-")
        tap_heads = random_tap_heads(model, args.methods.split(","), args.dflash_layers, heads_dir.name)
        rec["tap_heads"] = {"dflash_layers": args.dflash_layers, "note": "random weights, the target's layer shape"}
    rec["init_s"] = round(time.perf_counter() - t0, 2)
    log(f"{name}: built target ({rec['layers']} layers){' and draft' if draft else ''} in {rec['init_s']}s")
    if args.cache_dir != "none":
        rec["precompile"] = precompile(model, draft, configs, args.batch, args.compile_threads)
        log(f"{name}: precompiled {rec['precompile']['executables']} executables in {rec['precompile']['wall_s']}s "
            f"(lowering {rec['precompile']['lower_s']}s of it)")
    res.save()
    prompts = common.prompt_ids(args.batch, args.prompt_len, model.config.vocab_size)
    n, reps = args.new_tokens, args.repeats
    prefill = _run(model, prompts, 1, None, reps)
    rec["prefill_s"] = prefill["seconds"]
    plain = _run(model, prompts, n, None, reps)
    reference = plain.pop("token_ids")
    rec["plain"] = _summarise(plain, rec["prefill_s"], args.batch)
    replay_ref, rec["replay_reference"] = _replay_reference(model, prompts, n, reference, configs)
    log(f"{name}: plain {rec['plain']['tokens_per_s']:.1f} tok/s, decode {fmt(rec['plain']['decode_tokens_per_s'], 1)} "
        f"tok/s ({fmt(rec['plain']['step_ms'])} ms/step), prefill {rec['prefill_s'] * 1e3:.1f} ms")
    res.save()
    for c in configs:
        what = f"{name} {c['method']} k={c['k']}" + (f" alpha={c['alpha']}" if "alpha" in c else "")
        if not budget.allows(2 + 2 * plain["seconds"] * (reps + 1)):
            res.skip(what, "budget")
            continue
        try:
            spec = SpeculativeConfig(method=c["method"], num_speculative_tokens=c["k"],
                                     draft_model=tap_heads[c["method"]] if c["method"] in TAP_METHODS
                                     else draft if c["method"] == "draft_model" else None,
                                     replay_tokens=replay_ref if c["method"] == "replay" else None,
                                     replay_alpha=c.get("alpha", 1.0))
            run = _run(model, prompts, n, spec, reps)
            ids = run.pop("token_ids")
            item = {**c, **_summarise(run, rec["prefill_s"], args.batch), **_parity(ids, reference)}
            if c["method"] == "replay":  # replay's reference is the speculative path's own output
                item["parity_with_reference"] = _parity(ids, replay_ref)["identical_fraction"]
            if c["method"] == "replay":
                a = c["alpha"]
                item["expected_tau"] = (1 - a ** (c["k"] + 1)) / (1 - a) if a < 1 else c["k"] + 1.0
            rec["runs"].append(item)
            log(f"  {what}: {item['tokens_per_s']:.1f} tok/s, tau {item['tau']:.2f}, round {fmt(item['step_ms'])} ms")
        except Exception as e:
            res.error(what, e)
            for m in (model, draft):  # a failed step may have consumed the donated caches: start afresh
                if m is not None:
                    m._engines.clear()
        res.save()
    if budget.allows(2 + plain["seconds"] * (reps + 1)):  # drift check: plain again at the end
        after = _run(model, prompts, n, None, reps)
        after.pop("token_ids")
        rec["plain_after"] = _summarise(after, rec["prefill_s"], args.batch)
    _derive(rec)
    res.save()
    if heads_dir is not None:
        heads_dir.cleanup()
    del model, draft
    gc.collect()


def _summarise(run: dict, prefill_s: float, batch: int) -> dict:
    """Whole-run and decode-only rates; decode = run minus the separately measured prefill (None
    when the difference is lost in noise, which happens only for tiny smoke runs)."""
    decode_s = run["seconds"] - prefill_s
    decode_s = decode_s if decode_s > 0.05 * run["seconds"] else None
    out = {k: v for k, v in run.items() if k != "token_ids"}
    out.update(tokens_per_s=run["tokens"] / run["seconds"], decode_s=decode_s,
               decode_tokens_per_s=_div(run["tokens"] - batch, decode_s),
               step_ms=_div(decode_s, max(run["steps"], 1) / 1e3))
    return out


def _div(a, b):
    return None if a is None or b is None or b == 0 else a / b


def _derive(rec: dict) -> None:
    """Speedups and the cost model, per run (see the module docstring)."""
    plain = rec["plain"]
    replay_round = {r["k"]: r["step_ms"] for r in rec["runs"] if r["method"] == "replay"}
    for r in rec["runs"]:
        r["speedup"] = _div(r["decode_tokens_per_s"], plain["decode_tokens_per_s"])
        r["speedup_e2e"] = _div(r["tokens_per_s"], plain["tokens_per_s"])
        verify = replay_round.get(r["k"])
        r["verify_ms"] = verify
        if r["method"] == "replay":
            r["drafter_ms"] = 0.0  # its drafter is a gather: the replay round is the verify cost
        else:
            r["drafter_ms"] = None if verify is None or r["step_ms"] is None else r["step_ms"] - verify
        r["c"] = _div(r["drafter_ms"], verify)
        r["c_round"] = _div(r["step_ms"], plain["step_ms"]) - 1 if r["step_ms"] and plain["step_ms"] else None
        r["model_speedup"] = _div(r["tau"] * plain["step_ms"], r["step_ms"]) if plain["step_ms"] else None
        r["model_speedup_simple"] = r["tau"] / (1 + r["c"]) if r["c"] is not None and r["c"] > -1 else None
        r["verify_over_decode"] = _div(verify, plain["step_ms"])


def print_tables(res) -> None:
    rows = []
    for rec in res.data["results"]:
        if "plain" not in rec:
            continue
        p = rec["plain"]
        rows.append([rec["shape"], "plain", "", "", fmt(p["tokens_per_s"], 1), fmt(p["decode_tokens_per_s"], 1), "1.00",
                     "", fmt(p["step_ms"]), "", "1.00", "", ""])
        for r in rec["runs"]:
            rows.append([rec["shape"], r["method"], r["k"], r.get("alpha", ""), fmt(r["tokens_per_s"], 1),
                         fmt(r["decode_tokens_per_s"], 1), fmt(r["tau"]), fmt(r.get("expected_tau")),
                         fmt(r["step_ms"]), fmt(r["c"]), fmt(r["speedup"]), fmt(r["model_speedup"]),
                         fmt(r["identical_fraction"])])
        if rec.get("plain_after"):
            a = rec["plain_after"]
            rows.append([rec["shape"], "plain(after)", "", "", fmt(a["tokens_per_s"], 1),
                         fmt(a["decode_tokens_per_s"], 1), "1.00", "", fmt(a["step_ms"]), "", "", "", ""])
    print("\nend to end, greedy (speedup = decode tok/s over plain; model = tau * t_decode / t_round)")
    print(common.format_table(rows, ["shape", "method", "k", "alpha", "tok/s", "decode tok/s", "tau", "E[tau]",
                                     "ms/round", "c", "speedup", "model", "parity"]))


def main(argv=None) -> int:
    args = parse(argv)
    names = common.shape_names(args.shapes, ("demo-qwen3.5",) if args.smoke else ("qwen3.5-2b", "qwen3-4b"))
    layers = common.parse_layers(args.layers, names)
    budget = common.Budget(args.budget_s)
    res = common.Results("e2e", args)
    res.data["cache_dir"] = common.setup_jax(args.cache_dir)
    for i, name in enumerate(names):
        if not budget.allows():
            res.skip(name, "budget spent")
            continue
        share = budget.left() / (len(names) - i) if math.isfinite(budget.left()) else None
        try:
            run_shape(name, layers[name], args, res, common.Budget(share) if share else budget)
        except Exception as e:
            res.error(name, e)
        gc.collect()
    res.finish()
    print_tables(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
