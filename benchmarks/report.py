#!/usr/bin/env python
"""Summarise a results directory (what run_all.sh wrote): every script's tables into summary.md,
and a compact version on stdout (the part of a long GPU run's output that is read first): status
per script, bandwidth, verify fits and floor ratios, eager ratio, e2e speedups, peers, kernels.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402
from benchmarks.common import fmt  # noqa: E402

SCRIPTS = ("step_times", "e2e", "kernels", "peers", "profile_step", "demo_drafters", "startup", "throughput", "soak")


class _Doc:
    def __init__(self, data: dict):
        self.data = data


def _load(directory: Path) -> dict[str, dict]:
    out = {}
    for name in SCRIPTS:
        path = directory / f"{name}.json"
        if path.exists():
            try:
                out[name] = json.loads(path.read_text())
            except json.JSONDecodeError as e:
                out[name] = {"status": f"unreadable: {e}", "results": [], "errors": [], "skipped": []}
    return out


def _full_tables(docs: dict[str, dict]) -> str:
    """Each script's own print_tables output (imported lazily: step_times and kernels import jax)."""
    buf = io.StringIO()
    for name, data in docs.items():
        try:
            module = __import__(f"benchmarks.{name}", fromlist=["print_tables"])
            with contextlib.redirect_stdout(buf):
                print(f"\n## {name}\n")
                module.print_tables(_Doc(data))
        except Exception as e:
            buf.write(f"\n## {name}: could not tabulate ({type(e).__name__}: {e})\n")
    return buf.getvalue()


def compact(docs: dict[str, dict], status: str) -> str:
    lines = []
    if status:
        lines += ["run_all status (script, exit code, seconds, note):", status.rstrip()]
    for name, d in docs.items():
        lines.append(f"{name}: {d.get('status')}, {len(d.get('results', []))} results, {len(d.get('skipped', []))} "
                     f"skipped, {len(d.get('errors', []))} errors, {d.get('wall_s', '?')} s")
        for e in d.get("errors", [])[:4]:
            lines.append(f"  error {e['what']}: {e['error'][:160]}")
    st = docs.get("step_times")
    if st:
        bw = st.get("bandwidth", {})
        lines.append(f"\nbandwidth {fmt(bw.get('tb_per_s'), 3)} TB/s on {st['env'].get('device_kind')}")
        rows = []
        for rec in st["results"]:
            label = rec["shape"] + (f"[{rec['layers']}L]" if rec.get("layers") != rec.get("full_layers") else "")
            for b in rec.get("batches", []):
                f = b["fit"].get("pipelined_ms")
                ok = [i for i in b["items"] if "error" not in i]
                ratios = " ".join(f"{i['T']}:{i['ratio_to_floor']:.1f}" for i in ok)
                ms = " ".join(f"{i['T']}:{i['pipelined_ms']:.2f}" for i in ok if i.get("pipelined_ms") is not None)
                rows.append([label, b["R"], f"{f['a_ms']:.2f}{f['b_ms_per_token']:+.3f}t" if f else "-", ms, ratios])
            e = rec.get("eager")
            if e:
                rows.append([label, 1, "eager/captured", f"{fmt(e['eager_latency_ms'], 1)} / "
                             f"{fmt(e['captured_latency_ms'], 2)} ms", fmt(e["eager_over_captured"], 1)])
        lines += ["step times (pipelined ms by t; x floor by t)",
                  common.format_table(rows, ["shape", "R", "fit", "ms", "x floor"])]
    e2e = docs.get("e2e")
    if e2e:
        rows = []
        for rec in e2e["results"]:
            if "plain" in rec:
                rows.append([rec["shape"], "plain", "", "", fmt(rec["plain"]["decode_tokens_per_s"], 1), "", "", ""])
            for r in rec.get("runs", []):
                rows.append([rec["shape"], r["method"], r["k"], r.get("alpha", ""), fmt(r["decode_tokens_per_s"], 1),
                             fmt(r["tau"]), fmt(r["speedup"]), fmt(r["model_speedup"])])
        lines += ["e2e (decode tok/s; speedup vs plain; model = tau * t_decode / t_round)",
                  common.format_table(rows, ["shape", "method", "k", "alpha", "tok/s", "tau", "speedup", "model"])]
    peers = docs.get("peers")
    if peers:
        rows = []
        for rec in peers["results"]:
            for mode, out in rec.get("modes", {}).items():
                rows.append([rec["shape"], rec.get("batch", 1), mode,
                             "refused" if "refused" in out else fmt(out.get("tokens_per_s"), 1),
                             fmt(out.get("first_call_s"), 1)])
        lines += ["HF peers (tok/s, first call s)",
                  common.format_table(rows, ["shape", "B", "mode", "tok/s", "first s"])]
    kern = docs.get("kernels")
    if kern:
        by: dict = {}
        for r in kern["results"]:
            if r["B"] in (1, 32) and r["T"] in (1, 16, 64):
                by.setdefault((r["kernel"], r["layout"], r["B"], r["T"]), {})[r["impl"]] = r
        rows = []
        for (kernel, layout, B, T), impls in by.items():
            us = {i: impls[i]["us"] if i in impls else None for i in ("pallas", "xla", "fla")}
            p = impls.get("pallas")
            rows.append([kernel, layout, B, T, fmt(us["pallas"], 1), fmt(us["xla"], 1), fmt(us["fla"], 1),
                         fmt(p and p["ratio_to_floor"])])
        lines += ["kernels (us per call, B in 1 and 32, T in 1, 16 and 64; every row in summary.md)",
                  common.format_table(rows, ["kernel", "layout", "B", "T", "pallas", "xla", "fla", "pallas x floor"])]
    return "\n".join(lines)


HEADLINE_SHAPES = ("qwen3-4b", "qwen3.5-2b")


def _tok_s(run: dict | None):
    return None if not run else run.get("tokens_per_s")


def headline(directory: Path) -> dict:
    """The headline numbers of one GPU run, per shape: jaxspec plain and speculative (replay alpha
    0.8, k 7) tokens/s from e2e.json, HF eager and static cache + torch.compile from peers.json, and
    the decode step's wall, GPU-busy and bytes-floor times from profile_step_<shape>.json (batch 1,
    the engine's greedy decode round), with the bandwidth the floor used, and the cold and warm time
    to first token from startup.json."""
    docs = _load(directory)
    env = next((d["env"] for d in docs.values() if d.get("env", {}).get("device_kind")), {})
    out: dict = {"gpu": env.get("gpu") or env.get("device_kind"), "jax": env.get("versions", {}).get("jax"),
                 "date": env.get("date_utc")}
    for shape in HEADLINE_SHAPES:
        row: dict = {}
        for rec in docs.get("e2e", {}).get("results", []):
            if rec.get("shape") == shape and rec.get("batch") == 1 and "plain" in rec:
                row["plain_tok_s"] = _tok_s(rec["plain"])
                spec = [r for r in rec.get("runs", []) if r["method"] == "replay" and r["k"] == 7
                        and r.get("alpha") == 0.8]
                row["spec_replay_a0.8_k7_tok_s"] = _tok_s(spec[0]) if spec else None
                row["spec_replay_a0.8_k7_tau"] = spec[0]["tau"] if spec else None
        for rec in docs.get("peers", {}).get("results", []):
            if rec.get("shape") == shape and rec.get("batch", 1) == 1:
                modes = rec.get("modes", {})
                row["hf_static_compile_tok_s"] = _tok_s(modes.get("static_compile"))
                row["hf_eager_tok_s"] = _tok_s(modes.get("eager"))
        prof = directory / f"profile_step_{shape}.json"
        if prof.exists():
            d = json.loads(prof.read_text())
            decode = next((r for r in d.get("results", []) if r["step"].startswith("decode (engine round, greedy")),
                          None)
            if decode:  # the wall of a long loop: the steady column where the run has it (docs/benchmarks.md)
                row.update(decode_step_wall_ms=decode.get("steady_ms") or decode["pipelined_ms"],
                           decode_step_pipelined_8_ms=decode["pipelined_ms"],
                           decode_device_busy_ms=decode["device_busy_ms"], decode_floor_ms=decode["floor_ms"])
            row["bandwidth_tb_s"] = d.get("bandwidth", {}).get("tb_per_s")
        for rec in docs.get("startup", {}).get("results", []):
            if rec.get("shape") == shape:
                for run in ("cold", "warm"):
                    row[f"startup_{run}_ttft_s"] = rec.get("runs", {}).get(run, {}).get("ttft_s")
        plain, hf = row.get("plain_tok_s"), row.get("hf_static_compile_tok_s")
        row["plain_over_hf_static_compile"] = plain / hf if plain and hf else None
        spec = row.get("spec_replay_a0.8_k7_tok_s")
        row["spec_over_hf_static_compile"] = spec / hf if spec and hf else None
        out[shape] = row
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("directory", nargs="?", default=str(common.RESULTS_DIR), help="results directory")
    p.add_argument("--out", default=None, help="markdown path (default: <directory>/summary.md)")
    args = p.parse_args(argv)
    directory = Path(args.directory)
    docs = _load(directory)
    status_path = directory / "run_all_status.tsv"
    status = status_path.read_text() if status_path.exists() else ""
    short = compact(docs, status)
    out = Path(args.out) if args.out else directory / "summary.md"
    out.write_text("# Benchmark summary\n\n```\n" + short + "\n```\n\n# Full tables\n\n```\n" + _full_tables(docs)
                   + "\n```\n")
    print(short)
    print(f"\nwrote {out}")
    head = headline(directory)
    (directory / "headline.json").write_text(json.dumps(head, indent=1) + "\n")
    print("headline:", json.dumps(head, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
