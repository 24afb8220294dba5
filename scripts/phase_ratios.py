"""Do the prices of step shapes relative to plain decoding move with the machine's speed phase?

    .venv/bin/python scripts/phase_ratios.py --seconds 150 --out results/phase-ratios-s51
    .venv/bin/python scripts/phase_ratios.py --reanalyse results/phase-ratios-s51/phase_ratios.json --out results/phase-ratios-s51

On the AVX2 EPYC of sessions 50-51 the same projections took 24 ms in one minute and 39 ms ten minutes later
(`python -m dspark.bench.kernels`): another tenant takes memory bandwidth. A plain step streams the weights once and
is bound by that bandwidth; a verify step adds arithmetic per row, which the other tenant does not slow. If so, the
price of a verify step relative to a plain one is not a constant of the machine but falls when the machine is slow,
and a profile measured in one phase misprices the other. Times grid cells (R requests verifying k tokens each) in
shuffled rounds; each sample is divided by the one-request plain step (1x1) of its round, and the rounds are split
into quartiles of the phase: the median 1x1 time of the four rounds before and the four after (not its own, whose
noise would tilt the ratio against its own quartile: binned by its own 1x1, a ratio falls from the fast quartile to
the slow one by regression to the mean alone). Prints the median ratio per quartile, and how much each ratio
scatters from round to round (robust relative sigma, 1.4826 MAD / median) with the samples a median needs for a 1 %
standard error. `--reanalyse FILE` reads a saved phase_ratios.json instead of timing.
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


def time_rounds(dtype: str, seconds: float) -> list[dict]:
    """Shuffled rounds of every shape for ``seconds``: each round's seconds by (R, k)."""
    step = grid_step_fn(load_model("smollm2-135m-instruct", dtype=dtype).model)
    for r, k in SHAPES:
        step(r, k)
    rounds, rng, t_end = [], random.Random(0), time.time() + seconds
    while time.time() < t_end:
        order = list(SHAPES)
        rng.shuffle(order)
        times = {}
        for r, k in order:
            t0 = time.perf_counter()
            step(r, k)
            times[(r, k)] = time.perf_counter() - t0
        rounds.append(times)
    return rounds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=180.0)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default=None, metavar="DIR")
    ap.add_argument("--reanalyse", default=None, metavar="FILE", help="a saved phase_ratios.json: no timing")
    args = ap.parse_args()
    if args.reanalyse:
        saved = json.loads(Path(args.reanalyse).read_text())
        rounds = [{tuple(int(x) for x in key.split("x")): v for key, v in t.items()} for t in saved["samples_s"]]
        seconds = saved.get("seconds", args.seconds)
    else:
        rounds, seconds = time_rounds(args.dtype, args.seconds), args.seconds
    own = np.array([t[(1, 1)] for t in rounds])  # [rounds]
    n = len(rounds)
    phase = np.array([np.median(np.r_[own[max(0, i - 4):i], own[i + 1:i + 5]]) for i in range(n)])  # [rounds]
    quart = np.searchsorted(np.quantile(phase, [0.25, 0.5, 0.75]), phase)  # [rounds] 0..3, fastest first
    lines = [f"{args.dtype}, {n} shuffled rounds in {seconds:.0f} s; phase (neighbours' 1x1) quartile medians (ms): "
             + ", ".join(f"{1e3 * np.median(phase[quart == q]):.1f}" for q in range(4))]
    report = {"machine": machine_info(), "rounds": n, "seconds": seconds, "shapes": {}}
    for r, k in SHAPES:
        if (r, k) == (1, 1):
            continue
        ratio = np.array([t[(r, k)] for t in rounds]) / own
        per_q = [float(np.median(ratio[quart == q])) for q in range(4)]
        sigma = 1.4826 * float(np.median(np.abs(ratio - np.median(ratio)))) / float(np.median(ratio))
        need = int(np.ceil((1.2533 * sigma / 0.01) ** 2))
        lines.append(f"{r}x{k} / 1x1 by phase (fast -> slow): " + " ".join(f"{v:.3f}" for v in per_q)
                     + f"   all {np.median(ratio):.3f}   scatter {sigma:.3f} ({need} samples for 1 %)")
        report["shapes"][f"{r}x{k}"] = {"by_quartile": per_q, "median": float(np.median(ratio)), "scatter": sigma}
    print("\n".join(lines))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "phase_ratios.txt").write_text("\n".join(lines) + "\n")
        report["samples_s"] = [{f"{r}x{k}": v for (r, k), v in t.items()} for t in rounds]
        report["seconds"] = seconds
        (out / "phase_ratios.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
