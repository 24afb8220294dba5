"""Would the drafter's projections be cheaper in bf16? Times SmolLM2-135M drafter-shaped products, weights cold.

    .venv/bin/python scripts/bf16_projection_cost.py --out results/bf16-projections

For the draft LM head (16,384 × 576), the draft layer's gate/up and down projections and the Markov head's output
projection (16,384 × 64), at 1, 4 and 8 rows (`--rows`):
the fp32 path the drafter uses now (`Projection` with the C kernel for 1-2 rows, pre-packed oneDNN above) against
oneDNN with bf16 weights and bf16 activations (fp32 accumulation; fast only on CPUs with AVX512-BF16 or AMX). A
64 MiB buffer is written between calls so the weights come from memory as they do in an engine step; the two
paths alternate within each repeat. The shipped drafter's weights are stored in bf16, so only the activations and
the draft LM head (the target's fp32 embedding rows) would be rounded — which changes the drafter's q, not the
exactness of verification.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from dspark.bench.common import machine_info, markdown_table, write_results
from dspark.models.layers import Projection

SHAPES = (("draft LM head", 16384, 576), ("gate_up", 3072, 576), ("down", 576, 1536), ("Markov w2", 16384, 64))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,4,8")
    ap.add_argument("--repeats", type=int, default=25)
    ap.add_argument("--only", default=None, help="comma-separated projection names (default: all)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    flush = torch.randn(64 * 2**20 // 4)
    results = []
    for name, n, k in SHAPES:
        if args.only and name not in args.only.split(","):
            continue
        weight = torch.randn(n, k) / k**0.5
        fp32 = Projection(weight.contiguous(), packed=True, native=True)
        bf16 = Projection(weight.bfloat16().contiguous(), packed=True, native=False)
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k)
            xb = x.bfloat16()
            times = {"fp32": [], "bf16": []}
            for _ in range(args.repeats):
                for path, fn in (("fp32", lambda: fp32(x)), ("bf16", lambda: bf16(xb))):
                    flush.add_(1.0)
                    t0 = time.perf_counter()
                    fn()
                    times[path].append(time.perf_counter() - t0)
            ms = {p: 1e3 * statistics.median(v) for p, v in times.items()}
            results.append({"projection": name, "rows": m, "fp32_ms": ms["fp32"], "bf16_ms": ms["bf16"],
                            "fp32_over_bf16": ms["fp32"] / ms["bf16"]})
    table = markdown_table(["projection", "rows", "fp32 ms", "bf16 ms", "fp32 / bf16"],
                           [[r["projection"], r["rows"], f"{r['fp32_ms']:.3f}", f"{r['bf16_ms']:.3f}",
                             f"{r['fp32_over_bf16']:.2f}"] for r in results])
    title = f"# Drafter projections, fp32 vs bf16, median ms over {args.repeats} repeats, weights cold\n\n"
    print(title + table)
    if args.out is not None:
        write_results(args.out, "bf16_projections", {"machine": machine_info(), "results": results}, title + table)


if __name__ == "__main__":
    main()
