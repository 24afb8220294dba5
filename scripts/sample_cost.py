"""What does one inverse-CDF draw cost, torch's two-level path against the C kernel (decoding/native_sample.py)?

    .venv/bin/python scripts/sample_cost.py [--rows 1,4,16,32] [--vocab 49152] [--repeats 7] [--out DIR]

One draw of `rows` tokens from softmax rows of the vocabulary's width (SmolLM2's 49,152 by default), as a plain
step at T = 1 makes one a request; the softmax before it is timed beside them for scale. Mean µs over 300 calls,
median over repeats, the paths interleaved repeat by repeat so that drift hits both alike. Every repeat also
checks that both drew the same tokens. Writes sample_cost.json and sample_cost.md.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from dspark.bench.common import machine_info, markdown_table, write_results
from dspark.decoding import native_sample
from dspark.decoding.sampling import _sample_by_blocks


def per_call_us(fn, calls: int = 300) -> float:
    for _ in range(20):
        fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def measure(rows: int, vocab: int, repeats: int) -> dict:
    g = torch.Generator().manual_seed(rows)
    logits = torch.randn(rows, vocab, generator=g) * 3
    probs = torch.softmax(logits, -1)
    u = torch.rand(rows, generator=g, dtype=torch.float64)
    times = {"softmax": [], "torch": [], "kernel": []}
    for _ in range(repeats):
        if not torch.equal(_sample_by_blocks(probs, u), native_sample.sample_blocks(probs, u)):
            raise SystemExit(f"the kernel drew other tokens than torch at {rows} rows")
        times["softmax"].append(per_call_us(lambda: torch.softmax(logits, -1)))
        times["torch"].append(per_call_us(lambda: _sample_by_blocks(probs, u)))
        times["kernel"].append(per_call_us(lambda: native_sample.sample_blocks(probs, u)))
    return {"rows": rows, **{f"{k}_us": statistics.median(v) for k, v in times.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,4,16,32")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default="results/sample-cost")
    args = ap.parse_args()
    if native_sample.kernel() is None:
        raise SystemExit("the sampling kernel did not build here (no C compiler, or DSPARK_NATIVE=0)")
    cells = [measure(int(r), args.vocab, args.repeats) for r in args.rows.split(",")]
    table = markdown_table(["rows", "softmax µs", "draw, torch µs", "draw, C kernel µs", "torch / kernel"],
                           [[c["rows"], c["softmax_us"], c["torch_us"], c["kernel_us"], c["torch_us"] / c["kernel_us"]]
                            for c in cells])
    md = (f"# One inverse-CDF draw over {args.vocab} tokens: torch's two-level path and the C kernel\n\n"
          f"Median over {args.repeats} interleaved repeats of the mean of 300 calls; same tokens checked each "
          f"repeat. `{' '.join(['scripts/sample_cost.py', '--rows', args.rows, '--vocab', str(args.vocab)])}`\n\n"
          f"{table}\n")
    write_results(Path(args.out), "sample_cost", {"machine": machine_info(), "vocab": args.vocab, "cells": cells}, md)
    print(md)


if __name__ == "__main__":
    main()
