"""What does a target step cost against its shape? R requests verifying k tokens each, timed in shuffled rounds.

    .venv/bin/python scripts/step_shape_cost.py [--shapes 1x1,1x2,...] [--rounds 40] [--max-rows 2,8]

The speed profile's grid measures a few (R, k) cells and interpolates linearly between them; this prints the
median and quartiles of each shape asked for, so a cell the grid skips can be checked against its neighbours.
On the dev CPU the price is a staircase in B = R·k where the kernel changes: until session 20, 1-2 rows went
through our C kernel (models/native.py), 3-8 through oneDNN at about the same cost as each other; rows past the
C kernel's limit are padded to a bucket (layers.bucket_rows: a multiple of 4 up to 64 rows).
With --max-rows, every shape is timed under each limit on the rows our C kernel serves (models/kernel_choice.py;
by default the limit measured for this machine), the settings interleaved inside each round so that the VM's
drifting speed hits them alike.
"""
from __future__ import annotations

import argparse
import random
import time

import numpy as np

from dspark.engine.profiling import grid_step_fn
from dspark.models import load_model
from dspark.models import kernel_choice

DEFAULT = "1x1,1x2,1x3,1x4,1x5,1x6,1x7,1x8,2x2,2x3,2x4,2x5,2x8,4x1,4x2,4x3,4x4"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--shapes", default=DEFAULT, help="RxK pairs, comma-separated")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--dtype", default="float32", help="the target's dtype")
    ap.add_argument("--max-rows", default=None,
                    help="comma-separated limits on our C kernel's rows to compare (default: the one measured here)")
    args = ap.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    model = load_model(args.model, dtype=args.dtype).model
    limits = [int(x) for x in args.max_rows.split(",")] if args.max_rows else [model.lm_head.native_rows]
    pads = model.lm_head.pad_to  # the measured padding stays; only the C kernel's limit varies
    step = grid_step_fn(model, None)
    cells = [(r, k, m) for r, k in shapes for m in limits]
    times: dict[tuple[int, int, int], list[float]] = {c: [] for c in cells}
    rng = random.Random(0)
    for i in range(args.rounds + 1):  # round 0 warms up every cell and is not recorded
        for r, k, m in rng.sample(cells, len(cells)):
            kernel_choice.apply(model, kernel_choice.Routes(m, pads))
            t0 = time.perf_counter()
            step(r, k)
            if i:
                times[(r, k, m)].append(time.perf_counter() - t0)
    base = float(np.median(times[cells[0]]))
    print(f"{'R':>3} {'k':>3} {'B':>4} {'max_rows':>8}  median ms  (25-75 %)      / first cell")
    for (r, k, m), ts in times.items():
        q1, med, q3 = np.percentile(np.array(ts) * 1e3, [25, 50, 75])
        print(f"{r:3d} {k:3d} {r * k:4d} {m:8d}  {med:8.1f}   ({q1:5.1f}-{q3:5.1f})   {med / 1e3 / base:5.2f}")


if __name__ == "__main__":
    main()
