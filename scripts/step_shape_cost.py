"""What does a target step cost against its shape? R requests verifying k tokens each, timed in shuffled rounds.

    .venv/bin/python scripts/step_shape_cost.py [--shapes 1x1,1x2,...] [--rounds 40]

The speed profile's grid measures a few (R, k) cells and interpolates linearly between them; this prints the
median and quartiles of each shape asked for, so a cell the grid skips can be checked against its neighbours.
On the dev CPU the price is a staircase in B = R·k: 1-2 rows go through our C kernel (models/native.py), 3-8
through oneDNN at about the same cost as each other, and more rows are padded to a bucket (layers.bucket_rows:
16 for 9-16 rows until session 17, now a multiple of 4 up to 32).
"""
from __future__ import annotations

import argparse
import random
import time

import numpy as np

from dspark.engine.profiling import grid_step_fn
from dspark.models import load_model

DEFAULT = "1x1,1x2,1x3,1x4,1x5,1x6,1x7,1x8,2x2,2x3,2x4,2x5,2x8,4x1,4x2,4x3,4x4"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--shapes", default=DEFAULT, help="RxK pairs, comma-separated")
    ap.add_argument("--rounds", type=int, default=40)
    args = ap.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    step = grid_step_fn(load_model(args.model).model, None)
    for r, k in shapes:  # warm-up
        step(r, k)
    times: dict[tuple[int, int], list[float]] = {s: [] for s in shapes}
    rng = random.Random(0)
    for _ in range(args.rounds):
        for r, k in rng.sample(shapes, len(shapes)):
            t0 = time.perf_counter()
            step(r, k)
            times[(r, k)].append(time.perf_counter() - t0)
    base = float(np.median(times[shapes[0]]))
    print(f"{'R':>3} {'k':>3} {'B':>4}  median ms  (25-75 %)      / first shape")
    for (r, k), ts in times.items():
        q1, med, q3 = np.percentile(np.array(ts) * 1e3, [25, 50, 75])
        print(f"{r:3d} {k:3d} {r * k:4d}  {med:8.1f}   ({q1:5.1f}-{q3:5.1f})   {med / 1e3 / base:5.2f}")


if __name__ == "__main__":
    main()
