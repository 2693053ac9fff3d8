"""Command line: `jaxspec generate | precompile | info`. Flags map one to one onto API arguments."""

from __future__ import annotations

import argparse
import sys
import time

from jaxspec.speculative.config import METHODS, TAP_METHODS


def _positive(name: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name}={text!r} must be an integer") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{name}={value} must be >= 1")
        return value

    return parse


def _auto_or_positive(name: str):
    positive = _positive(name)

    def parse(text: str) -> int | str:
        return "auto" if text == "auto" else positive(text)

    return parse


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="demo",
                   help="HF checkpoint directory, a jaxspec.save directory, demo (trained Qwen3.5), demo-draft, "
                        "or demo:<family> (random weights) (default: demo)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="parameter and activation dtype (auto = the checkpoint's)")
    p.add_argument("--kernels", default="auto", choices=["auto", "xla", "pallas"],
                   help="kernel implementation (auto = Pallas on GPU, XLA reference elsewhere)")
    p.add_argument("--max-model-len", type=_positive("max-model-len"), default=None,
                   help="longest prompt + generation, in tokens")
    p.add_argument("--max-num-seqs", type=_positive("max-num-seqs"), default=8, help="requests decoded together")
    p.add_argument("--prefill-chunk", type=_auto_or_positive("prefill-chunk"), default="auto",
                   help="prompt tokens per prefill call row ('auto': 512 on GPUs, 64 elsewhere)")
    p.add_argument("--prefill-rows", type=_auto_or_positive("prefill-rows"), default="auto",
                   help="requests admitted together whose prompt chunks share one prefill call "
                        "('auto': min(8, max-num-seqs))")
    p.add_argument("--k-mode", default="per_k", choices=["per_k", "pad_to_max"],
                   help="one verify executable per k, or every k padded to the largest")
    p.add_argument("--rounds-per-dispatch", type=_positive("rounds-per-dispatch"), default=1,
                   help="decode steps / speculative rounds per executable call (read back together)")
    p.add_argument("--dispatch-ahead", type=int, default=1,
                   help="calls enqueued before the oldest one's tokens are read (0 = synchronous)")
    p.add_argument("--num-kv-pages", type=_positive("num-kv-pages"), default=None,
                   help="KV pool pages incl. the null page (default: sized from the memory budget)")
    p.add_argument("--cache-dir", default="default",
                   help="persistent compilation cache (default: $JAXSPEC_CACHE_DIR or the user cache dir)")
    p.add_argument("--no-cache", action="store_true", help="disable the persistent compilation cache")
    p.add_argument("--tensor-parallel-size", type=_positive("tensor-parallel-size"), default=1,
                   help="devices the model is sharded over (heads, MLP / expert intermediate, vocabulary)")
    p.add_argument("--coordinator-address", default=None,
                   help="several processes (hosts): host:port of process 0, for jax.distributed.initialize")
    p.add_argument("--num-processes", type=_positive("num-processes"), default=1,
                   help="with --coordinator-address: processes in the run")
    p.add_argument("--process-id", type=int, default=0, help="with --coordinator-address: this process's index")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxspec", description="Speculative decoding for Qwen3 / Qwen3.5 / Qwen3-Next in JAX.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    gen = sub.add_parser("generate", help="generate text from a prompt",
                         description="Generate a continuation and print it with a one-line stats summary.")
    _add_model_flags(gen)
    gen.add_argument("prompt", nargs="+", help="prompt text (several prompts are batched)")
    gen.add_argument("--max-new-tokens", type=_positive("max-new-tokens"), default=64,
                     help="tokens to generate per prompt")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=0, help="0 = off")
    gen.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed")
    gen.add_argument("--speculative", choices=METHODS, default=None, help="speculative decoding method")
    gen.add_argument("--k", type=_positive("k"), default=3, help="draft tokens per round (with --speculative)")
    gen.add_argument("--dynamic-k", action="store_true",
                     help="--k is the largest k; each round runs the k bucket (powers of two below it, and it) "
                          "with the most expected tokens per unit of cost, from recent acceptance")
    gen.add_argument("--draft-model", default=None,
                     help="draft model path or demo name (--speculative draft_model), or the EAGLE-3 / DFlash "
                          "checkpoint directory or demo name (--speculative eagle3 / dflash)")
    gen.add_argument("--replay-alpha", type=float, default=0.8,
                     help="replay drafter acceptance control in [0, 1] (--speculative replay)")
    gen.add_argument("--chat", action="store_true",
                     help="send each prompt as one user chat message, rendered with the model's chat template")
    gen.add_argument("--stream", action="store_true", help="print tokens as they are produced")
    gen.add_argument("--verbose", action="store_true",
                     help="report start-up: load time, time to first token, compilations vs cache loads")
    pre = sub.add_parser("precompile", help="compile the bucket table into the persistent cache",
                         description="AOT-compile every executable that generate can use for these settings "
                                     "and store it in the persistent compilation cache.")
    _add_model_flags(pre)
    pre.add_argument("--k", type=_positive("k"), action="append", default=[],
                     help="speculative k to compile (repeatable); none = plain decoding only")
    pre.add_argument("--method", choices=METHODS, action="append", default=[],
                     help="drafter to compile for (repeatable; default ngram)")
    pre.add_argument("--draft-model", default=None, help="draft model for --method draft_model, eagle3 or dflash")
    pre.add_argument("--dynamic-k", action="store_true",
                     help="each --k is the largest k of --dynamic-k generation: also compile its smaller k buckets")
    info = sub.add_parser("info", help="print a model's config, size, memory plan and bucket table")
    _add_model_flags(info)
    info.add_argument("--k", type=_positive("k"), action="append", default=[], help="speculative k (repeatable)")
    return parser


def _load(args, path=None, k_values=()):
    import jaxspec

    max_k = max(k_values) if args.k_mode == "pad_to_max" and k_values else 0
    return jaxspec.load(path or args.model, dtype=args.dtype, kernels=args.kernels, max_model_len=args.max_model_len,
                        max_num_seqs=args.max_num_seqs, prefill_chunk=args.prefill_chunk,
                        prefill_rows=args.prefill_rows,
                        max_num_speculative_tokens=max_k, k_mode=args.k_mode,
                        rounds_per_dispatch=args.rounds_per_dispatch, dispatch_ahead=args.dispatch_ahead,
                        num_kv_pages=args.num_kv_pages, tensor_parallel_size=args.tensor_parallel_size,
                        cache_dir=None if args.no_cache else args.cache_dir)


def _speculative(args, model, prompts):
    import jaxspec

    if args.speculative is None:
        if args.dynamic_k:
            raise ValueError("--dynamic-k needs --speculative METHOD")
        return None
    dyn = dict(dynamic_k=args.dynamic_k)
    if args.speculative == "draft_model":
        if not args.draft_model:
            raise ValueError("--speculative draft_model needs --draft-model PATH")
        return jaxspec.SpeculativeConfig("draft_model", args.k, draft_model=_load(args, args.draft_model, (args.k,)),
                                         **dyn)
    if args.speculative == "replay":  # reference = the target's own greedy continuation
        ref = jaxspec.generate(model, prompts, max_new_tokens=args.max_new_tokens + args.k + 1).token_ids
        return jaxspec.SpeculativeConfig("replay", args.k, replay_tokens=ref, replay_alpha=args.replay_alpha, **dyn)
    if args.speculative in TAP_METHODS:
        if not args.draft_model:
            raise ValueError(f"--speculative {args.speculative} needs --draft-model PATH (or demo-{args.speculative})")
        return jaxspec.SpeculativeConfig(args.speculative, args.k, draft_model=args.draft_model, **dyn)
    return jaxspec.SpeculativeConfig(args.speculative, args.k, **dyn)  # ngram, mtp


def _cmd_generate(args) -> int:
    import jaxspec
    from jaxspec.compile import count_compiles

    start = time.perf_counter()
    with count_compiles() as compiles:
        model = _load(args, k_values=(args.k,) if args.speculative else ())
        loaded = time.perf_counter()
        prompts = [[{"role": "user", "content": p}] for p in args.prompt] if args.chat else list(args.prompt)
        spec = _speculative(args, model, prompts)
        stream = jaxspec.generate(model, prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                  top_k=args.top_k, top_p=args.top_p, seed=args.seed, speculative=spec, stream=True)
        outputs, first_token, exe = [[] for _ in prompts], None, (0.0, 0.0)
        for index, new in stream:
            if first_token is None:
                first_token, exe = time.perf_counter(), (compiles.trace_seconds, compiles.compile_seconds)
            outputs[index].extend(new)
            if args.stream and model.tokenizer is not None:
                print(model.tokenizer.decode(new), end="", flush=True)
    if args.stream:
        print()
    for i, ids in enumerate(outputs):
        text = model.tokenizer.decode(ids) if model.tokenizer is not None else " ".join(map(str, ids))
        if len(outputs) > 1:
            print(f"--- [{i}]")
        print(text if args.chat else prompts[i] + text)  # a chat prints the reply only
    stats = getattr(stream, "stats", None)
    if stats is not None:
        print(f"[jaxspec] {stats.summary()}", file=sys.stderr)
        if stats.verify_steps:
            by_pos = " ".join(f"{a:.2f}" for a in stats.acceptance_by_position)
            print(f"[jaxspec] acceptance by draft position: {by_pos}", file=sys.stderr)
    if args.verbose:
        _print_startup(start, loaded, first_token or time.perf_counter(), exe, compiles)
    return 0


def _print_startup(start: float, loaded: float, first_token: float, exe: tuple[float, float], compiles) -> None:
    """The start-up line (benchmarks/startup.py parses it): load, time to first token and, split
    up to the first token, the time in tracing and in XLA compiles / persistent-cache loads
    (docs/benchmarks.md, "Compile and start-up"); `command` ends after the output is printed."""
    cache = "warm" if compiles.backend_compiles and compiles.compiles == 0 else "cold"
    trace, build = exe
    rest = first_token - loaded - trace - build
    print(f"[jaxspec] start-up: load {loaded - start:.2f}s, time to first token {first_token - start:.2f}s; "
          f"{compiles.compiles} XLA compilations, {compiles.cache_hits} persistent-cache loads ({cache} cache); "
          f"after load: tracing {trace:.2f}s, executables {build:.2f}s, other {rest:.2f}s; "
          f"command {time.perf_counter() - start:.2f}s", file=sys.stderr)


def _memory_lines(model, k_values) -> list[str]:
    from jaxspec.engine import memory_plan

    lines = []
    for k in sorted({max(k, model.max_num_speculative_tokens) for k in (0, *k_values)}):
        ecfg = model.engine_config(k)
        plan = memory_plan(model, ecfg)
        parts = ", ".join(f"{name} {b / 2**20:.2f} MiB" for name, b in plan.items())
        lines.append(f"  caches k_max={k}, per device: {parts}; total {sum(plan.values()) / 2**20:.2f} MiB; KV pool "
                     f"{ecfg.total_pages - 1} pages = {(ecfg.total_pages - 1) * ecfg.page_size} concurrent tokens "
                     f"(max_num_seqs x max_model_len = {ecfg.max_num_seqs * ecfg.max_model_len})")
    return lines


def _cmd_precompile(args) -> int:
    from jaxspec import compile as jc

    model = _load(args, k_values=args.k)
    methods = tuple(dict.fromkeys(args.method or ["ngram"]))
    draft = None
    needs = [m for m in methods if m == "draft_model" or m in TAP_METHODS]
    if len(needs) > 1:
        raise ValueError(f"--method {', '.join(needs)}: each needs its own --draft-model; "
                         f"precompile them one at a time")
    if needs and not args.draft_model:
        raise ValueError(f"--method {needs[0]} needs --draft-model PATH")
    if "draft_model" in needs:
        draft = _load(args, args.draft_model, args.k)
    elif needs:  # an eagle3 / dflash head, loaded as SpeculativeConfig loads it
        from jaxspec.speculative.config import SpeculativeConfig

        draft = SpeculativeConfig(needs[0], 1, draft_model=args.draft_model).draft_model
    table = jc.bucket_table(model, k_values=args.k, methods=methods if args.k else (), draft_model=draft,
                            dynamic_k=args.dynamic_k)
    print("bucket table:\n" + jc.print_table(table))
    print("memory plan:\n" + "\n".join(_memory_lines(model, args.k)))
    jc.check_table_memory(model, table, draft)
    reports = jc.precompile(model, table, draft_model=draft)
    print(jc.format_reports(reports))
    hits = sum(r.cache in ("hit", "memory") for r in reports)
    exe = sum(r.memory_bytes or 0 for r in reports)
    print(f"{len(reports)} executables, {hits} served from the cache, {len(reports) - hits} compiled; "
          f"executables {exe / 2**20:.2f} MiB")
    return 0


def _cmd_info(args) -> int:
    from jaxspec import compile as jc
    from jaxspec.cache import params_bytes

    model = _load(args, k_values=args.k)
    cfg = model.config
    count = sum(int(x.size) for x in __import__("jax").tree_util.tree_leaves(model.params))
    print(f"model: {args.model} ({cfg.model_type}, family {cfg.family})")
    for name, value in sorted(vars(cfg).items()):
        print(f"  {name}: {value}")
    print(f"parameters: {count:,} ({params_bytes(model.params) / 2**20:.2f} MiB as {model.dtype.__name__})")
    print(f"kernels: {_kernels_line(model)}")
    print(f"loop: {model.rounds_per_dispatch} round(s) per dispatch, {model.dispatch_ahead} dispatch(es) ahead "
          f"of the read-back")
    print(f"mesh: {_mesh_line(model)}")
    print("memory plan:\n" + "\n".join(_memory_lines(model, args.k)))
    table = jc.bucket_table(model, k_values=args.k, methods=("ngram",))
    print("bucket table:\n" + jc.print_table(table))
    if model.config.mesh is not None:
        print("collectives per step (compiled HLO of the largest request bucket, greedy):")
        for bucket, counts in jc.step_collectives(model, table):
            found = ", ".join(f"{n} {op}" for op, n in counts.items()) or "none"
            print(f"  {bucket.name} {bucket.describe()}: {found}")
    return 0


def _kernels_line(model) -> str:
    from jaxspec import ops
    from jaxspec.models import packing

    line = f"{model.kernels} -> {ops.resolve_kernels(model.kernels)}"
    if any(packing.is_packed_layer(layer) for layer in model.params["layers"]):
        line += ("; input projections (GDN, attention q / k / v, MLP gate / up) packed into one weight per layer "
                 "(docs/architecture.md)")
    return line


def _mesh_line(model) -> str:
    import jax

    mesh = model.config.mesh
    if mesh is None:
        return f"one device ({jax.devices()[0]})"
    devices = ", ".join(str(d.id) for d in mesh.devices.flat)
    return (f"tensor parallel {mesh.size} over devices [{devices}] ({jax.default_backend()}, "
            f"{jax.process_count()} process(es))")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.coordinator_address:  # before anything touches a device
            from jaxspec.sharding import initialize_distributed

            initialize_distributed(args.coordinator_address, args.num_processes, args.process_id)
        return {"generate": _cmd_generate, "precompile": _cmd_precompile, "info": _cmd_info}[args.command](args)
    except (ValueError, FileNotFoundError, OSError, RuntimeError) as e:
        print(f"jaxspec {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
