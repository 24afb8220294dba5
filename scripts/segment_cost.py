"""What one more request costs the target's forward at a fixed token count: B tokens as one request or as many.

    .venv/bin/python scripts/segment_cost.py [--dtype bfloat16]

Each request in a step is an attention segment with its own cache writes, key slices and (for more than one token)
mask, so 16 requests of 1 token cost more than 1 request of 16 tokens. The speed profile models this
(`SpeedProfile.segment_seconds`); this prints the raw medians it rests on, 300-token contexts, 9 interleaved repeats,
for both attention paths side by side: the C kernel (one call per layer for all short segments,
models/native_attention.py) and torch's per-request loop (the reference). With no kernel, the torch column only.
The kernel takes only segments up to its dtype's limit (`native_attention.max_queries`; `--kernel-limit N` moves
it, to find the crossover); longer ones go to torch in both columns.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from dspark.models import load_model, native_attention
from dspark.models.transformer import Segment

CONTEXT = 300
CASES = {"1 x 1": [1], "1 x 4": [4], "1 x 8": [8], "1 x 12": [12], "2 x 4": [4, 4], "8 x 1": [1] * 8,
         "4 x 4": [4] * 4, "4 x 8": [8] * 4, "1 x 16": [16], "16 x 1": [1] * 16, "1 x 64": [64], "16 x 4": [4] * 16}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--kernel-limit", type=int, help="longest segment the C kernel takes (default: the dtype's)")
    args = ap.parse_args()
    if args.kernel_limit:
        native_attention.MAX_QUERIES = native_attention.MAX_QUERIES_BF16 = args.kernel_limit
    model = load_model("smollm2-135m-instruct", dtype=args.dtype).model
    caches = []
    for _ in range(16):
        cache = model.new_cache(CONTEXT + 64)
        model.forward(torch.arange(CONTEXT) % 1000, [Segment(cache, 0, CONTEXT)])
        caches.append(cache)

    def step(parts: list[int]) -> None:
        model.forward(torch.zeros(sum(parts), dtype=torch.long),
                      [Segment(c, CONTEXT, n) for c, n in zip(caches, parts)])
        for c in caches[:len(parts)]:
            c.truncate(CONTEXT)

    paths = [False, True] if model.native_attention else [False]
    for flag in paths:  # warm-up
        model.native_attention = flag
        for parts in CASES.values():
            step(parts)
    times = {(name, flag): [] for name in CASES for flag in paths}
    for _ in range(9):
        for name, parts in CASES.items():
            for flag in paths:
                model.native_attention = flag
                t0 = time.perf_counter()
                step(parts)
                times[name, flag].append(time.perf_counter() - t0)
    print("requests x tokens each\tms per forward, torch attention\tC kernel\tratio (medians)")
    for name in CASES:
        torch_ms = 1e3 * np.median(times[name, False])
        if len(paths) == 1:
            print(f"{name}\t{torch_ms:.1f}")
            continue
        native_ms = 1e3 * np.median(times[name, True])
        print(f"{name}\t{torch_ms:.1f}\t{native_ms:.1f}\t{native_ms / torch_ms:.2f}")


if __name__ == "__main__":
    main()
