"""How the dev machine's speed drifts while a profile is measured, and how little the ratios between steps do.

    .venv/bin/python scripts/profile_drift.py --seconds 60 --dtype bfloat16 [--out FILE]

Times a few of the profile's grid cells (R requests verifying k tokens each, `engine/profiling.grid_step_fn`) in
shuffled rounds for the given time and prints, per cell, the median and 10 / 90 % quantiles, then the 5-second
medians of one-request plain decoding (1x1) and of 2x3 over time, and their ratio per 5-second bin: the levels
move with the machine, the ratio much less, which is why `measure_profile` reads every sample against a
reference step timed just before it (``reference_every``).
"""
from __future__ import annotations

import argparse
import random
import time

import numpy as np

from dspark.engine.profiling import grid_step_fn
from dspark.models import load_model

SHAPES = ((1, 1), (2, 1), (2, 2), (2, 3), (32, 8))  # the last: a large step between the small ones, as in a profile


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--bin", type=float, default=5.0, help="seconds per bin of the time series")
    ap.add_argument("--out", default=None, metavar="FILE", help="also write the report here")
    args = ap.parse_args()
    model = load_model("smollm2-135m-instruct", dtype=args.dtype).model
    step = grid_step_fn(model)
    for shape in SHAPES:
        step(*shape)
        step(*shape)
    samples: dict[tuple[int, int], list[tuple[float, float]]] = {s: [] for s in SHAPES}  # (when, seconds)
    rng, start = random.Random(0), time.perf_counter()
    while time.perf_counter() - start < args.seconds:
        for shape in rng.sample(SHAPES, len(SHAPES)):
            t0 = time.perf_counter()
            step(*shape)
            samples[shape].append((t0 - start, time.perf_counter() - t0))
    lines = [f"{args.dtype}, {args.seconds:g} s of shuffled rounds"]
    for (r, k), xs in samples.items():
        q = 1e3 * np.quantile([s for _, s in xs], [0.5, 0.1, 0.9])
        lines.append(f"{r}x{k}: median {q[0]:.2f} ms (10-90 %: {q[1]:.2f}-{q[2]:.2f}), {len(xs)} samples")
    binned = {s: _bins(samples[s], args.bin) for s in ((1, 1), (2, 3))}
    lines.append(f"{args.bin:g}-second medians, ms: 1x1 {binned[(1, 1)]}")
    lines.append(f"{args.bin:g}-second medians, ms: 2x3 {binned[(2, 3)]}")
    lines.append("2x3 / 1x1 per bin: " + str([round(b / a, 2) for a, b in zip(binned[(1, 1)], binned[(2, 3)])]))
    report = "\n".join(lines)
    print(report)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(report + "\n")


def _bins(xs: list[tuple[float, float]], width: float) -> list[float]:
    when = np.array([t for t, _ in xs])
    secs = np.array([s for _, s in xs])
    return [round(1e3 * float(np.median(secs[(when // width) == b])), 1) for b in np.unique(when // width)]


if __name__ == "__main__":
    main()
