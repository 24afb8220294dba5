"""One scheduler's throughput over the fastest fixed policy and over none, paired within each repeat and pooled
over several `bench serve` runs (each run may name the scheduler differently, e.g. the default in one run and the
same settings spelled as options in another).

    .venv/bin/python scripts/pooled_scheduler_ratios.py results/serving-s52-amd-avx2-chain-t1/serving.json:async \
        results/serving-s52-amd-avx2-k-margin-t1/serving.json:async:k_margin=0 \
        results/serving-s52-amd-avx2-low-t1/serving.json:async
"""
from __future__ import annotations

import argparse
import json

import numpy as np

from dspark.bench.serving import paired_ratios


def paired(path: str, name: str) -> dict[int, list[tuple[float, float]]]:
    """concurrency -> [(scheduler / fastest fixed policy, scheduler / none)] for each repeat of one run, as
    `bench serve` pairs them (``paired_ratios``)."""
    rows = paired_ratios(json.load(open(path))["runs"], name)
    return {r["concurrency"]: list(zip(r["vs_best_fixed"], r["vs_none"])) for r in rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", metavar="SERVING_JSON:POLICY")
    args = ap.parse_args()
    pooled: dict[int, list[tuple[float, float]]] = {}
    for spec in args.runs:
        path, name = spec.split(":", 1)
        for c, pairs in paired(path, name).items():
            pooled.setdefault(c, []).extend(pairs)
    print("| C | repeats | over the fastest fixed policy: median [min, max] | over none | each repeat over the fastest |")
    print("|---|---|---|---|---|")
    for c, pairs in sorted(pooled.items()):
        a = np.array(pairs)
        print(f"| {c} | {len(a)} | {np.median(a[:, 0]):.3f} [{a[:, 0].min():.3f}, {a[:, 0].max():.3f}] | "
              f"{np.median(a[:, 1]):.3f} [{a[:, 1].min():.3f}, {a[:, 1].max():.3f}] | "
              f"{', '.join(f'{x:.3f}' for x in a[:, 0])} |")


if __name__ == "__main__":
    main()
