"""Grouped bar chart of attention TFLOP/s from a benchmark JSON.

    python benchmarks/plot.py IN.json OUT.png [--title TEXT] [--providers ours fa4 sdpa-cudnn]

IN.json is either what ``benchmarks/bench.py --out DIR`` writes (``DIR/bench.json``: an object whose
``results`` rows carry ``provider``, ``hdim``, ``seqlen``, ``causal``, ``dir`` and ``tflops``), or a
plain list of rows ``{"problem": "d128 causal 8k", "provider": "ours", "direction": "fwd",
"tflops": 702}``. One panel per direction (fwd, bwd), one group of bars per problem, one bar per
provider. Rows without a number (a provider that errored) are left out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

# Display names and colours of the providers bench.py knows; others keep their own name.
LABELS = {
    "ours": "cute-flash",
    "fa4": "flash-attn-4",
    "sdpa-cudnn": "cuDNN (SDPA)",
    "sdpa-flash": "FA2 (SDPA)",
    "ours-det": "cute-flash, deterministic",
    "fa4-det": "flash-attn-4, deterministic",
    "ours-sm80": "cute-flash, sm80 kernels",
}
COLORS = {
    "ours": "tab:red",
    "fa4": "tab:blue",
    "sdpa-cudnn": "tab:green",
    "sdpa-flash": "tab:purple",
    "ours-det": "tab:orange",
    "fa4-det": "tab:cyan",
    "ours-sm80": "tab:brown",
}
DIRECTIONS = ("fwd", "bwd")


def _problem(row: dict[str, Any]) -> str:
    n = int(row["seqlen"])
    size = f"{n // 1024}k" if n % 1024 == 0 else str(n)
    return f"d{row['hdim']} {'causal' if row['causal'] else 'dense'} {size}"


def load_rows(path: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(rows of problem / provider / direction / tflops, meta) from either JSON format."""
    data = json.loads(path.read_text())
    meta: dict[str, Any] = {}
    if isinstance(data, dict):
        meta = data.get("meta", {})
        rows = [{"problem": _problem(r), "provider": r["provider"], "direction": r["dir"],
                 "tflops": r.get("tflops")} for r in data["results"]]
    elif isinstance(data, list):
        rows = [{"problem": r["problem"], "provider": r["provider"], "direction": r["direction"],
                 "tflops": r.get("tflops")} for r in data]
    else:
        raise ValueError(f"{path}: expected bench.py's JSON object or a list of rows")
    return [r for r in rows if r["tflops"]], meta


def _ordered(values: list[str]) -> list[str]:
    return list(dict.fromkeys(values))


def plot(rows: list[dict[str, Any]], out: Path, title: str, providers: list[str] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    providers = providers or _ordered([r["provider"] for r in rows])
    directions = [d for d in DIRECTIONS if any(r["direction"] == d for r in rows)]
    directions += _ordered([r["direction"] for r in rows if r["direction"] not in directions])
    value = {(r["direction"], r["problem"], r["provider"]): float(r["tflops"]) for r in rows}
    problems = {d: _ordered([r["problem"] for r in rows if r["direction"] == d]) for d in directions}
    width = 0.8 / max(len(providers), 1)

    widest = max(len(p) for p in problems.values())
    # Rotated tick labels take height: long problem names get taller panels.
    longest = max(len(name) for names in problems.values() for name in names)
    fig, axes = plt.subplots(len(directions), 1, squeeze=False,
                             figsize=(max(8.0, 0.62 * widest + 2), (2.6 + 0.055 * longest) * len(directions)))
    for ax, direction in zip(axes[:, 0], directions, strict=True):
        names = problems[direction]
        for i, p in enumerate(providers):
            xs = [j + (i - (len(providers) - 1) / 2) * width for j in range(len(names))]
            ys = [value.get((direction, name, p), 0.0) for name in names]
            ax.bar(xs, ys, width, label=LABELS.get(p, p), color=COLORS.get(p))
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=45, ha="right", fontsize=8)
        ax.set_ylabel("TFLOP/s")
        ax.set_title({"fwd": "forward", "bwd": "backward"}.get(direction, direction), fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
        ax.legend(fontsize=8, ncols=len(providers), loc="upper left")
        ax.set_ylim(0, max([v for (d, _, _), v in value.items() if d == direction] + [1.0]) * 1.18)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", type=Path, help="bench.py's bench.json, or a list of rows")
    ap.add_argument("png", type=Path, help="output image")
    ap.add_argument("--title", default=None, help="default: from the JSON's meta")
    ap.add_argument("--providers", nargs="*", default=None, help="bars and their order (default: as found)")
    args = ap.parse_args(argv)
    rows, meta = load_rows(args.json)
    if not rows:
        print(f"{args.json}: no rows with a TFLOP/s value", file=sys.stderr)
        return 1
    default_title = ", ".join(str(meta[k]) for k in ("device", "dtype", "shape") if k in meta)
    title = args.title or default_title or "TFLOP/s"
    plot(rows, args.png, title, args.providers)
    print(f"wrote {args.png} ({len(rows)} bars)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
