#!/usr/bin/env python
"""The trained demo pair's drafters on held-out standard-library prompts (issue 9): tau, acceptance by
draft position and tokens/s of draft_model, ngram, mtp (the target's own MTP head) and the shipped
tap drafters eagle3 and dflash ("demo-eagle3", "demo-dflash"; skipped, with the reason recorded,
where this installation does not ship them) at k in {2, 4, 7, 15} (where the drafter allows the k),
and with dynamic k up to the largest of them (drafters that support it), against plain greedy, on
whatever backend runs the script (CPU or GPU).

Prompts: the first --prompt-len tokens of held-out standard-library files (the split
tools/train_demo.py never trains on: sha256(relative path) % 20 == 0), in path order. Every
configuration generates exactly --new-tokens per prompt (EOS ignored) through `jaxspec.generate`
with --batch prompts per step, after one warm-up call (compile excluded); tokens/s and the speedup
are medians over --repeats calls. Greedy output with a drafter is checked to equal plain greedy.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dataclasses  # noqa: E402
import statistics  # noqa: E402

from benchmarks import common  # noqa: E402
from benchmarks.common import fmt, log  # noqa: E402
from jaxspec.demo import DemoModelError  # noqa: E402
from jaxspec.speculative.config import DYNAMIC_K_METHODS  # noqa: E402

SMOKE = dict(num_prompts=2, prompt_len=24, new_tokens=8, ks="2", repeats=1)
METHODS = ("draft_model", "ngram", "mtp", "eagle3", "dflash")
TAP_DEMOS = {"eagle3": "demo-eagle3", "dflash": "demo-dflash"}


def parse(argv=None):
    p = common.parser(__doc__.split("\n\n")[0], shapes=False)
    p.add_argument("--num-prompts", type=int, default=16, help="held-out files used as prompts")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens taken from each file")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated per prompt (exact)")
    p.add_argument("--ks", default="2,4,7,15", help="draft lengths")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--batch", type=int, default=1, help="prompts decoded together (max_num_seqs)")
    p.add_argument("--no-dynamic-k", dest="dynamic_k", action="store_false",
                   help="skip the dynamic-k rows (largest k = max of --ks; methods that support it)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--kernels", default="auto", choices=["auto", "xla", "pallas"])
    p.set_defaults(repeats=3)
    args = common.parse_args(p, argv, SMOKE)
    common.check_choices("--methods", args.methods, METHODS, "method")
    if args.num_prompts < 1 or args.prompt_len < 1 or args.new_tokens < 1 or args.batch < 1:
        raise SystemExit("--num-prompts, --prompt-len, --new-tokens and --batch must be >= 1")
    return args


def heldout_prompts(tokenizer, num: int, length: int) -> tuple[list[list[int]], list[str]]:
    """(token ids, file names): the first `length` tokens of the first `num` held-out files that have
    at least that many tokens."""
    sys.path.insert(0, str(common.REPO / "tools"))
    import train_demo

    prompts, names = [], []
    for rel, text in train_demo.stdlib_files(include_tests=True):
        if train_demo.file_bucket(rel) != train_demo.HELDOUT_BUCKET:
            continue
        ids = tokenizer.encode(text)
        if len(ids) >= length:
            prompts.append(ids[:length])
            names.append(rel)
        if len(prompts) == num:
            break
    return prompts, names


def run_config(target, prompts, args, speculative=None) -> dict:
    import jaxspec

    kwargs = dict(max_new_tokens=args.new_tokens, speculative=speculative)
    jaxspec.generate(target, prompts, **kwargs)  # warm-up: every executable compiled
    runs = [jaxspec.generate(target, prompts, **kwargs) for _ in range(args.repeats)]
    stats = runs[-1].stats
    seconds = statistics.median(r.stats.seconds for r in runs)
    return {"token_ids": runs[-1].token_ids, "seconds": seconds, "tokens": stats.tokens,
            "tokens_per_s": stats.tokens / seconds, "tau": stats.tau, "acceptance": stats.acceptance_rate,
            "acceptance_by_position": stats.acceptance_by_position, "verify_steps": stats.verify_steps,
            "stats": dataclasses.asdict(stats)}


def main(argv=None) -> int:
    args = parse(argv)
    import jax

    import jaxspec

    res = common.Results("demo_drafters", args)
    budget = common.Budget(args.budget_s)
    ks = common.int_list(args.ks)
    settings = dict(dtype=args.dtype, kernels=args.kernels, max_num_seqs=args.batch,
                    max_model_len=args.prompt_len + args.new_tokens + max(ks) + 2, max_num_speculative_tokens=max(ks))
    target = jaxspec.load("demo", **settings)
    target = dataclasses.replace(target, config=target.config.replace(eos_token_ids=()), _engines={})  # exact lengths
    draft = jaxspec.load("demo-draft", **settings)
    prompts, names = heldout_prompts(target.tokenizer, args.num_prompts, args.prompt_len)
    res.data.update(prompts=names, backend=jax.default_backend(), settings=settings)
    log(f"{len(prompts)} held-out prompts of {args.prompt_len} tokens, {args.new_tokens} new tokens each, "
        f"batch {args.batch}, backend {jax.default_backend()}")
    plain = run_config(target, prompts, args)
    res.add({"method": "plain", "k": 0, **{k: v for k, v in plain.items() if k != "token_ids"}})
    log(f"plain: {plain['tokens_per_s']:.1f} tok/s")
    for method in args.methods.split(","):
        dynamic = [True] if args.dynamic_k and method in DYNAMIC_K_METHODS and max(ks) > 1 else []
        for k, dyn in [(k, False) for k in ks] + [(max(ks), d) for d in dynamic]:
            name = f"{method} k={k}{' dynamic' if dyn else ''}"
            if not budget.allows():
                res.skip(name, "budget spent")
                continue
            try:
                spec = jaxspec.SpeculativeConfig(method, k, draft_model=TAP_DEMOS.get(method, draft)
                                                 if method in ("draft_model", *TAP_DEMOS) else None, dynamic_k=dyn)
            except (ValueError, DemoModelError) as e:  # not shipped, or a k this drafter does not allow
                res.skip(name, str(e))
                continue
            try:
                out = run_config(target, prompts, args, spec)
            except Exception as e:
                res.error(name, e)
                continue
            item = {"method": method, "k": k, "dynamic_k": dyn,
                    **{key: v for key, v in out.items() if key != "token_ids"},
                    "speedup": out["tokens_per_s"] / plain["tokens_per_s"],
                    "greedy_equal": out["token_ids"] == plain["token_ids"]}
            res.add(item)
            log(f"{name}: tau {item['tau']:.2f}, {item['tokens_per_s']:.1f} tok/s, "
                f"speedup {item['speedup']:.2f}, equal to plain: {item['greedy_equal']}, "
                f"rounds by k {out['stats']['k_histogram']}")
    res.finish()
    print_tables(res)
    return 0 if all(r.get("greedy_equal", True) for r in res.data["results"]) else 1


def _k_label(r) -> str:
    """k, or for dynamic k its largest k and the mean k the rounds ran."""
    if not r["k"]:
        return "-"
    if not r.get("dynamic_k"):
        return str(r["k"])
    hist = r["stats"]["k_histogram"]
    mean = sum(k * c for k, c in enumerate(hist)) / max(sum(hist), 1)
    return f"dyn<={r['k']} (mean {mean:.1f})"


def print_tables(res) -> None:
    d = res.data
    rows = [[r["method"], _k_label(r), fmt(r["tau"]), fmt(r["acceptance"]),
             " ".join(f"{a:.2f}" for a in r["acceptance_by_position"]) or "-", fmt(r["tokens_per_s"], 1),
             fmt(r.get("speedup", 1.0)), {True: "yes", False: "NO"}.get(r.get("greedy_equal"), "-")]
            for r in d["results"]]
    print(f"\ndemo pair on {len(d.get('prompts', []))} held-out prompts ({d.get('backend')}, {d['args']['dtype']}, "
          f"batch {d['args']['batch']})")
    print(common.format_table(rows, ["method", "k", "tau", "acceptance", "acceptance by position", "tok/s",
                                     "speedup", "== plain"]))


if __name__ == "__main__":
    sys.exit(main())
