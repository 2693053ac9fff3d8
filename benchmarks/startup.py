#!/usr/bin/env python
"""Start-up (issue 5): time to first token of `jaxspec generate` in fresh processes with a cold and a
warm persistent compilation cache, and after `jaxspec precompile`, for the published shapes.

Per shape: random bf16 weights are written once with `jaxspec.save` (byte-level tokenizer, so the
CLI takes a text prompt). Then, each in its own process and each timed from process start:
  cold       `jaxspec generate --verbose` with an empty cache directory;
  warm       the same command again (every executable a persistent-cache load);
  precompile `jaxspec precompile` of the same settings into a second empty cache directory;
  after      `jaxspec generate --verbose` on that directory (must compile nothing).
The CLI's own --verbose line gives load time, time to first token (from the command's start, after
imports) and the XLA compilation / cache-load counts, and splits the time after the load up to the
first token into tracing, executables (XLA compiles or persistent-cache loads) and the rest; process
wall time includes Python and JAX start-up (before_command_s: process time minus the command's).
HF's first-call compile time for comparison is in peers.py's JSON of the same run.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import os  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

from benchmarks import common  # noqa: E402
from benchmarks.common import fmt, log  # noqa: E402

SMOKE = dict(shapes="demo-qwen3.5", max_new_tokens=4, max_model_len=128, prefill_chunk=16, k=1)
STARTUP_LINE = re.compile(r"start-up: load (?P<load>[\d.]+)s, time to first token (?P<ttft>[\d.]+)s; "
                          r"(?P<compiles>\d+) XLA compilations, (?P<loads>\d+) persistent-cache loads")
PHASES = re.compile(r"after load: tracing (?P<trace>[-\d.]+)s, executables (?P<exe>[-\d.]+)s, "
                    r"other (?P<other>[-\d.]+)s; command (?P<command>[\d.]+)s")


RUNS = ("cold", "warm", "precompile", "after_precompile")


def parse(argv=None):
    p = common.parser(__doc__.split("\n\n")[0])
    p.add_argument("--speculative", default="ngram", help="drafter of the generate runs ('none' = plain)")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=1)
    p.add_argument("--prefill-chunk", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--format", default="safetensors", choices=["safetensors", "orbax"],
                   help="jaxspec.save params format of the checkpoint")
    p.add_argument("--runs", default=",".join(RUNS),
                   help="which fresh-process runs, in this order")
    p.add_argument("--workdir", default=None, help="checkpoints and cache directories (default: a temporary one)")
    p.add_argument("--timeout-s", type=float, default=600, help="limit per process")
    p.set_defaults(repeats=1)
    args = common.parse_args(p, argv, SMOKE, check=False)  # one process per run: no repeats
    common.check_choices("--runs", args.runs, RUNS, "run")
    return args


def _save_model(name: str, layers, args, directory: Path) -> float:
    """Random weights of the shape -> jaxspec.save directory, in a child process (its device memory
    is gone before the timed processes start). Returns seconds."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from benchmarks import common; import jaxspec, dataclasses;"
            "from jaxspec.tokenizer import ByteTokenizer;"
            "hf = common.shape_config(sys.argv[2], None if sys.argv[3] == 'None' else int(sys.argv[3]));"
            "m = common.build_model(hf, dtype=sys.argv[4], engine={});"
            "jaxspec.save(dataclasses.replace(m, tokenizer=ByteTokenizer()), sys.argv[5], format=sys.argv[6])")
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code, str(common.REPO), name, str(layers), args.dtype, str(directory),
                    args.format], check=True, timeout=args.timeout_s, cwd=common.REPO)
    return time.perf_counter() - start


def _cli(argv: list[str], args) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "jaxspec", *argv], capture_output=True, text=True,
                          timeout=args.timeout_s, cwd=common.REPO, env=env)
    out = {"argv": argv, "returncode": proc.returncode, "process_s": time.perf_counter() - start}
    match = STARTUP_LINE.search(proc.stderr)
    if match:
        out.update(load_s=float(match["load"]), ttft_s=float(match["ttft"]), compiles=int(match["compiles"]),
                   cache_loads=int(match["loads"]))
    phases = PHASES.search(proc.stderr)
    if phases:  # time to first token after the load, split; before_command_s: interpreter + imports + exit
        out.update(trace_s=float(phases["trace"]), executables_s=float(phases["exe"]),
                   other_s=float(phases["other"]), command_s=float(phases["command"]),
                   before_command_s=round(out["process_s"] - float(phases["command"]), 3))
    if proc.returncode:
        out["stderr_tail"] = proc.stderr[-3000:]
    return out


def run_shape(name: str, layers, args, res, work: Path) -> None:
    ckpt, cold_cache, pre_cache = work / f"{name}-ckpt", work / f"{name}-cache", work / f"{name}-cache-pre"
    for d in (ckpt, cold_cache, pre_cache):
        shutil.rmtree(d, ignore_errors=True)
    rec = res.add({"shape": name, "layers": common.shape_config(name, layers)["num_hidden_layers"],
                   "format": args.format, "runs": {}})
    rec["save_s"] = _save_model(name, layers, args, ckpt)
    log(f"{name}: saved in {rec['save_s']:.1f}s")
    settings = ["--model", str(ckpt), "--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
                "--max-num-seqs", str(args.max_num_seqs), "--prefill-chunk", str(args.prefill_chunk)]
    gen = ["generate", *settings, "--max-new-tokens", str(args.max_new_tokens), "--verbose"]
    if args.speculative != "none":
        gen += ["--speculative", args.speculative, "--k", str(args.k)]
    prompt = ["def fibonacci(n):"]
    pre = ["precompile", *settings, "--cache-dir", str(pre_cache)]
    if args.speculative != "none":
        pre += ["--k", str(args.k), "--method", args.speculative]
    plan = [("cold", [*gen, "--cache-dir", str(cold_cache), *prompt]),
            ("warm", [*gen, "--cache-dir", str(cold_cache), *prompt]),
            ("precompile", pre),
            ("after_precompile", [*gen, "--cache-dir", str(pre_cache), *prompt])]
    for label, argv in [(label, argv) for label, argv in plan if label in args.runs.split(",")]:
        rec["runs"][label] = run = _cli(argv, args)
        res.save()
        log(f"{name} {label}: process {run['process_s']:.1f}s, ttft {fmt(run.get('ttft_s'))}s, "
            f"{run.get('compiles', '-')} compilations, {run.get('cache_loads', '-')} cache loads, "
            f"rc {run['returncode']}")
        if run["returncode"]:
            res.data["errors"].append({"what": f"{name} {label}", "error": run.get("stderr_tail", "")[-800:]})
    shutil.rmtree(ckpt, ignore_errors=True)


def print_tables(res) -> None:
    rows = []
    for rec in res.data["results"]:
        for label, run in rec["runs"].items():
            rows.append([rec["shape"], label, fmt(run["process_s"], 1), fmt(run.get("before_command_s")),
                         fmt(run.get("load_s")), fmt(run.get("trace_s")), fmt(run.get("executables_s")),
                         fmt(run.get("other_s")), fmt(run.get("ttft_s")), run.get("compiles", "-"),
                         run.get("cache_loads", "-"), run["returncode"]])
    print("\nstart-up of `jaxspec generate` in fresh processes (seconds; ttft from the command's start = load + "
          "tracing + executables + other; before command = interpreter, imports and exit)")
    print(common.format_table(rows, ["shape", "run", "process s", "before command s", "load s", "tracing s",
                                     "executables s", "other s", "ttft s", "compilations", "cache loads", "rc"]))


def main(argv=None) -> int:
    args = parse(argv)
    names = common.shape_names(args.shapes, ("demo-qwen3.5",) if args.smoke else ("qwen3-4b", "qwen3.5-2b"))
    layers = common.parse_layers(args.layers, names)
    budget = common.Budget(args.budget_s)
    res = common.Results("startup", args, with_jax=False)
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="jaxspec-startup-"))
    for name in names:
        if not budget.allows():
            res.skip(name, "budget spent")
            continue
        try:
            run_shape(name, layers[name], args, res, work)
        except Exception as e:
            res.error(name, e)
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    res.finish()
    print_tables(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
