"""Every policy's throughput over a baseline's, paired within each repeat, from a `bench serve` serving.json.

    .venv/bin/python scripts/paired_ratios.py results/keep-cost-s27/serving.json --out results/keep-cost-s27/paired.md
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("serving_json", type=Path)
    ap.add_argument("--baseline", default="none")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    runs = json.loads(args.serving_json.read_text())["runs"]
    tput = {(r["policy"], r["concurrency"], r["repeat"]): r["throughput_tok_s"] for r in runs}
    policies = [p for p in dict.fromkeys(r["policy"] for r in runs) if p != args.baseline]
    lines = [f"Throughput over {args.baseline}, paired within each repeat: median [min, max] "
             f"({args.serving_json})", "", "| C | " + " | ".join(policies) + " |", "|---|" + "---|" * len(policies)]
    for c in sorted({r["concurrency"] for r in runs}):
        cells = []
        for p in policies:
            ratios = [tput[(p, c, i)] / tput[(args.baseline, c, i)] for (q, cc, i) in tput
                      if q == p and cc == c and (args.baseline, c, i) in tput]
            cells.append(f"{statistics.median(ratios):.3f} [{min(ratios):.3f}, {max(ratios):.3f}]" if ratios else "–")
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
