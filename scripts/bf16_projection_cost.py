"""Which kernel should serve each of the drafter's products? Times SmolLM2-135M drafter-shaped products, weights cold.

    .venv/bin/python scripts/bf16_projection_cost.py --out results/bf16-projections

For the draft LM head (16,384 × 576), the feature fusion (576 × 2,880), the draft layer's K/V rows of qkv, gate/up
and down projections and the Markov head's output projection (16,384 × 64), at 1, 2, 3, 4 and 8 rows (`--rows`),
four paths: our C kernel and pre-packed oneDNN, each with fp32 weights and with bf16 weights and activations (fp32
accumulation; fast only on CPUs with AVX512-BF16 or AMX; the bf16 C kernel needs AVX512-BF16). A 64 MiB buffer
is written between calls so the weights come from memory as they do in an engine step; the paths alternate within
each repeat. The shipped drafter's weights are stored in bf16, so only the activations and the draft LM head (the
target's fp32 embedding rows) would be rounded — which changes the drafter's q, not the exactness of
verification. `draft_kernels.FastLinear` routes by these numbers.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from dspark.bench.common import machine_info, markdown_table, write_results
from dspark.models import native
from dspark.models.layers import Projection

SHAPES = (("draft LM head", 16384, 576), ("fuse", 576, 2880), ("kv", 384, 576), ("gate_up", 3072, 576),
          ("down", 576, 1536), ("Markov w2", 16384, 64))
PATHS = ("fp32 C", "fp32 oneDNN", "bf16 C", "bf16 oneDNN")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,3,4,8")
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
        bf16 = Projection(weight.bfloat16().contiguous(), packed=True, native=True)
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k)
            xb = x.bfloat16()
            calls = {"fp32 C": lambda: native.linear(x, fp32.weight, None) if fp32.native else None,
                     "fp32 oneDNN": lambda: fp32.packed_linear(x) if fp32.packed is not None else None,
                     "bf16 C": lambda: native.linear(xb, bf16.weight, None) if bf16.native else None,
                     # torch packs no bf16 weights where oneDNN lacks bf16 instructions (AVX2): no such path
                     "bf16 oneDNN": lambda: bf16.packed_linear(xb) if bf16.packed is not None else None}
            times = {p: [] for p in PATHS}
            for _ in range(args.repeats):
                for path in PATHS:
                    flush.add_(1.0)
                    t0 = time.perf_counter()
                    done = calls[path]()
                    times[path].append(time.perf_counter() - t0 if done is not None else float("nan"))
            ms = {p: 1e3 * statistics.median(v) for p, v in times.items()}
            best = min((p for p in PATHS if ms[p] == ms[p]), key=ms.get)
            results.append({"projection": name, "rows": m, **{f"{p} ms": ms[p] for p in PATHS}, "fastest": best})
    table = markdown_table(["projection", "rows", *(f"{p} ms" for p in PATHS), "fastest"],
                           [[r["projection"], r["rows"], *(f"{r[f'{p} ms']:.3f}" for p in PATHS), r["fastest"]]
                            for r in results])
    title = f"# Drafter projections by kernel, median ms over {args.repeats} repeats, weights cold\n\n"
    print(title + table)
    if args.out is not None:
        write_results(args.out, "bf16_projections", {"machine": machine_info(), "results": results}, title + table)


if __name__ == "__main__":
    main()
