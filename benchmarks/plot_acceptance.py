#!/usr/bin/env python
"""Plot demo_drafters.json: for each drafter, the fraction of rounds whose draft at position i was
accepted (acceptance by position, at the drafter's largest fixed k), with tau and tok/s in the
legend. Writes a PNG (default docs/img/acceptance_by_position.png) and prints the plotted rows.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common, plot  # noqa: E402


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--input", default=None, help="demo_drafters JSON (default: benchmarks/results/demo_drafters.json)")
    p.add_argument("--out", default=None, help="PNG path (default: docs/img/acceptance_by_position.png)")
    p.add_argument("--smoke", action="store_true", help="plot the smoke run (demo_drafters_smoke.json)")
    args = p.parse_args(argv)
    suffix = "_smoke" if args.smoke else ""
    args.input = Path(args.input or common.RESULTS_DIR / f"demo_drafters{suffix}.json")
    args.out = Path(args.out or (common.RESULTS_DIR / "acceptance_smoke.png" if args.smoke
                                 else common.REPO / "docs" / "img" / "acceptance_by_position.png"))
    return args


def series(data: dict) -> list[dict]:
    """Per drafter, its fixed-k run with the largest k: acceptance by position, tau, tok/s."""
    best: dict[str, dict] = {}
    for r in data["results"]:
        if r["k"] and not r.get("dynamic_k") and r["k"] >= best.get(r["method"], {}).get("k", 0):
            best[r["method"]] = r
    return [{"method": m, "k": r["k"], "acceptance": r["acceptance_by_position"], "tau": r["tau"],
             "tokens_per_s": r["tokens_per_s"]} for m, r in best.items()]


def draw(lines: list[dict], path: Path, title: str) -> None:
    fig, ax = plot.pyplot().subplots(figsize=(7, 4.2))
    for s in lines:
        positions = range(1, len(s["acceptance"]) + 1)
        ax.plot(positions, s["acceptance"], "o-", label=f"{s['method']} k={s['k']}: tau {s['tau']:.2f}, "
                                                         f"{s['tokens_per_s']:.0f} tok/s")
    ax.set_xlabel("draft position i")
    ax.set_ylabel("rounds whose draft i was accepted")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    plot.save(fig, path)


def main(argv=None) -> int:
    args = parse(argv)
    data = json.loads(args.input.read_text())
    lines = series(data)
    if not lines:
        print(f"{args.input} has no speculative runs to plot")
        return 1
    env, a = data.get("env", {}), data["args"]
    title = (f"demo pair, {len(data.get('prompts', []))} held-out prompts x {a['new_tokens']} tokens, "
             f"{data.get('backend', '?')} {a['dtype']}, batch {a['batch']} ({env.get('date_utc', '')[:10]})")
    draw(lines, args.out, title)
    rows = [[s["method"], s["k"], f"{s['tau']:.2f}", " ".join(f"{x:.2f}" for x in s["acceptance"])] for s in lines]
    print(common.format_table(rows, ["method", "k", "tau", "acceptance by position"]))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
