"""Does a target step's cost depend on the step before it? R = 1 steps of 1 and 2 tokens, timed three ways.

    .venv/bin/python scripts/step_order_cost.py [--repeats 15]

The speed profile times every (R, k) shape in turn, each round visiting all of them; the engine at C = 1 runs
long stretches of one shape (plain decoding, or MTP-1) or alternates two (the async scheduler). If the price of a
2-token step relative to a 1-token one changes with what ran just before, the profile's R = 1 row cannot be read
as the engine's cost, whatever its number of repeats. Prints the median of each shape and their ratio for:
back-to-back bursts of one shape, the two shapes alternating, and each step preceded by a 32 x 8-token step.
"""
from __future__ import annotations

import argparse
import statistics
import time

from dspark.engine.profiling import _warm_caches, grid_step_fn
from dspark.models import load_model


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    step = grid_step_fn(load_model(args.model).model, None)
    one, two, big = (lambda: step(1, 1)), (lambda: step(1, 2)), (lambda: step(32, 8))
    for _ in range(3):
        one(), two(), big()
    n = range(args.repeats)
    burst = ([timed(one) for _ in n], [timed(two) for _ in n])
    alternating: tuple[list, list] = ([], [])
    after_big: tuple[list, list] = ([], [])
    for _ in n:
        alternating[0].append(timed(one))
        alternating[1].append(timed(two))
        big()
        after_big[0].append(timed(one))
        big()
        after_big[1].append(timed(two))
    for name, (t1, t2) in (("back-to-back", burst), ("alternating", alternating), ("after a 32x8 step", after_big)):
        m1, m2 = statistics.median(t1) * 1e3, statistics.median(t2) * 1e3
        print(f"{name:18s} 1 token {m1:6.1f} ms   2 tokens {m2:6.1f} ms   ratio {m2 / m1:.3f}", flush=True)


if __name__ == "__main__":
    main()
