#!/usr/bin/env python
"""Plot step_times.json: verify time vs tokens per request t (decode is t = 1) for every shape and
batch, with the least-squares fit and the physical floor (bytes / measured bandwidth) beside it.
Writes a PNG (default docs/img/verify_curve.png) and prints the fits it drew.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--input", default=None, help="step_times JSON (default: benchmarks/results/step_times.json)")
    p.add_argument("--out", default=None, help="PNG path (default: docs/img/verify_curve.png)")
    p.add_argument("--metric", default="pipelined_ms", choices=["pipelined_ms", "latency_ms"])
    p.add_argument("--smoke", action="store_true", help="plot the smoke run (step_times_smoke.json)")
    args = p.parse_args(argv)
    suffix = "_smoke" if args.smoke else ""
    args.input = Path(args.input or common.RESULTS_DIR / f"step_times{suffix}.json")
    args.out = Path(args.out or (common.RESULTS_DIR / "verify_curve_smoke.png" if args.smoke
                                 else common.REPO / "docs" / "img" / "verify_curve.png"))
    return args


def series(data: dict, metric: str) -> list[dict]:
    """One entry per (shape, batch): t, measured ms, floor ms, fit."""
    out = []
    for rec in data["results"]:
        label = rec["shape"] + (f" [{rec['layers']}/{rec['full_layers']} layers]"
                                if rec.get("layers") != rec.get("full_layers") else "")
        for b in rec.get("batches", []):
            items = sorted((i for i in b["items"] if "error" not in i and i.get(metric) is not None),
                           key=lambda i: i["T"])
            if items:
                out.append({"shape": label, "R": b["R"], "t": [i["T"] for i in items],
                            "ms": [i[metric] for i in items], "floor": [i["floor_ms"] for i in items],
                            "fit": b["fit"].get(metric)})
    return out


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    pyplot().close(fig)


def draw(lines: list[dict], path: Path, title: str) -> None:
    plt = pyplot()
    shapes = list(dict.fromkeys(s["shape"] for s in lines))
    cols = min(2, len(shapes)) or 1
    rows = -(-len(shapes) // cols) or 1
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 4.2 * rows), squeeze=False)
    for ax, shape in zip(axes.flat, shapes, strict=False):
        for n, s in enumerate(x for x in lines if x["shape"] == shape):
            color = f"C{n}"
            ax.plot(s["t"], s["ms"], "o", color=color, label=f"R={s['R']} measured")
            if s["fit"]:
                ts = [min(s["t"]), max(s["t"])]
                ax.plot(ts, [s["fit"]["a_ms"] + s["fit"]["b_ms_per_token"] * t for t in ts], "-", color=color,
                        alpha=0.6, label=f"R={s['R']} {s['fit']['a_ms']:.2f} {s['fit']['b_ms_per_token']:+.3f} t")
            ax.plot(s["t"], s["floor"], "--", color=color, alpha=0.8, label=f"R={s['R']} floor")
        ax.set_title(shape)
        ax.set_xlabel("tokens per request t (1 = decode, 1+k = verify)")
        ax.set_ylabel("ms per step")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(shapes):]:
        ax.axis("off")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    save(fig, path)


def main(argv=None) -> int:
    args = parse(argv)
    data = json.loads(args.input.read_text())
    lines = series(data, args.metric)
    if not lines:
        print(f"{args.input} has no step-time measurements to plot")
        return 1
    env = data.get("env", {})
    bw = data.get("bandwidth", {}).get("tb_per_s")
    title = (f"verify step vs floor ({args.metric}; {env.get('device_kind', '?')}, "
             f"{bw:.2f} TB/s measured; {env.get('date_utc', '')})" if bw else "verify step vs floor")
    draw(lines, args.out, title)
    rows = [[s["shape"], s["R"], " ".join(f"{t}:{m:.2f}" for t, m in zip(s["t"], s["ms"], strict=True)),
             f"{s['fit']['a_ms']:.3f} {s['fit']['b_ms_per_token']:+.3f} t" if s["fit"] else "-"] for s in lines]
    print(common.format_table(rows, ["shape", "R", "t:ms", "fit"]))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
