"""Every policy's throughput over a baseline's, paired within each repeat, from a `bench serve` serving.json.

    .venv/bin/python scripts/paired_ratios.py results/keep-cost-s27/serving.json --out results/keep-cost-s27/paired.md
    .venv/bin/python scripts/paired_ratios.py results/serving-s40-default-low/serving.json --scheduler async

With ``--scheduler`` it prints that scheduler's ratios as `bench serve` now writes them (``paired_ratios``): over the
fastest fixed policy of each repeat, over the fixed policy fastest over all repeats (named), and over none; for
runs made before the second column existed.
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
    ap.add_argument("--scheduler", default=None, help="this scheduler's ratios to the fixed policies instead")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    runs = json.loads(args.serving_json.read_text())["runs"]
    if args.scheduler:
        return _emit(_scheduler_table(runs, args.scheduler, args.serving_json), args.out)
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
    _emit("\n".join(lines) + "\n", args.out)


def _scheduler_table(runs: list[dict], scheduler: str, path: Path) -> str:
    from dspark.bench.serving import paired_ratios

    def span(v: list[float]) -> str:
        return f"{statistics.median(v):.3f} [{min(v):.3f}, {max(v):.3f}]" if v else "–"

    lines = [f"{scheduler}'s throughput, paired within each repeat: median [min, max] ({path})", "",
             "| C | / fastest fixed of each repeat | / best fixed policy (over all repeats) | / none |",
             "|---|---|---|---|"]
    for r in paired_ratios(runs, scheduler):
        lines.append(f"| {r['concurrency']} | {span(r['vs_best_fixed'])} | {span(r['vs_best_policy'])} "
                     f"({r['best_policy']}) | {span(r['vs_none'])} |")
    return "\n".join(lines) + "\n"


def _emit(text: str, out: Path | None) -> None:
    print(text)
    if out:
        out.write_text(text)


if __name__ == "__main__":
    main()
