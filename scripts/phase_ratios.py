"""Do the prices of step shapes relative to plain decoding move with the machine's speed phase?

    .venv/bin/python scripts/phase_ratios.py --seconds 180 --out results/phase-ratios-s51

On the AVX2 EPYC of sessions 50-51 the same projections took 24 ms in one minute and 39 ms ten minutes later
(`python -m dspark.bench.kernels`): another tenant takes memory bandwidth. A plain step streams the weights once and
is bound by that bandwidth; a verify step adds arithmetic per row, which the other tenant does not slow. If so, the
price of a verify step relative to a plain one is not a constant of the machine but falls when the machine is slow,
and a profile measured in one phase misprices the other. Times grid cells (R requests verifying k tokens each) in
shuffled rounds; each sample is divided by the one-request plain step (1x1) of its round, and the rounds are split
into quartiles of that 1x1 time (the phase): the median ratio per quartile, and the slope of ratio against 1x1 time.
"""
from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import numpy as np

from dspark.bench.common import machine_info
from dspark.engine.profiling import grid_step_fn
from dspark.models import load_model

SHAPES = ((1, 1), (1, 2), (1, 3), (1, 4), (2, 1), (2, 2), (4, 1), (4, 2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=180.0)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default=None, metavar="DIR")
    args = ap.parse_args()
    step = grid_step_fn(load_model("smollm2-135m-instruct", dtype=args.dtype).model)
    for r, k in SHAPES:
        step(r, k)
    rounds, rng, t_end = [], random.Random(0), time.time() + args.seconds
    while time.time() < t_end:
        order = list(SHAPES)
        rng.shuffle(order)
        times = {}
        for r, k in order:
            t0 = time.perf_counter()
            step(r, k)
            times[(r, k)] = time.perf_counter() - t0
        rounds.append(times)
    phase = np.array([t[(1, 1)] for t in rounds])  # [rounds]
    edges = np.quantile(phase, [0.25, 0.5, 0.75])
    quart = np.searchsorted(edges, phase)  # [rounds] 0..3, fastest first
    lines = [f"{args.dtype}, {len(rounds)} shuffled rounds in {args.seconds:.0f} s; 1x1 quartile medians (ms): "
             + ", ".join(f"{1e3 * np.median(phase[quart == q]):.1f}" for q in range(4))]
    report = {"machine": machine_info(), "rounds": len(rounds), "shapes": {}}
    for r, k in SHAPES:
        if (r, k) == (1, 1):
            continue
        ratio = np.array([t[(r, k)] for t in rounds]) / phase
        per_q = [float(np.median(ratio[quart == q])) for q in range(4)]
        slope = float(np.polyfit(phase * 1e3, ratio, 1)[0])  # ratio per ms of 1x1
        lines.append(f"{r}x{k} / 1x1 by phase (fast -> slow): " + " ".join(f"{v:.3f}" for v in per_q)
                     + f"   all {np.median(ratio):.3f}   slope {slope * 10:+.3f} per 10 ms of 1x1")
        report["shapes"][f"{r}x{k}"] = {"by_quartile": per_q, "median": float(np.median(ratio)), "slope_per_ms": slope}
    print("\n".join(lines))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "phase_ratios.txt").write_text("\n".join(lines) + "\n")
        report["samples_s"] = [{f"{r}x{k}": v for (r, k), v in t.items()} for t in rounds]
        (out / "phase_ratios.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
