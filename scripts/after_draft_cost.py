"""Does a target step cost more right after a drafter proposal than right after another target step?

    .venv/bin/python scripts/after_draft_cost.py --repeats 25 --out results/after-draft-s51

In the engine a plain step (K = 0) follows a plain step, while a verify step follows the proposal that drafted it.
The speed profile (engine/profiling.py) times every shape in a shuffled order in which ~40 % of the jobs are
proposals, so each target step is priced after a mix of both. If a proposal slows the target step after it, the
profile prices plain steps too high against verify steps, and the async scheduler drafts where plain decoding is
faster. Each round times, for each (R, k) shape in a shuffled order, the step right after a one-token target step of
the same R and right after a proposal of depth k (at least 1) for those R requests, and prints the medians, their
ratio, and the verify : plain ratio each order implies.
"""
from __future__ import annotations

import argparse
import random
import statistics
from pathlib import Path

import torch

from dspark.bench.common import machine_info, markdown_table, write_results
from dspark.drafters import make_drafter
from dspark.engine.profiling import _warm_caches, drafter_step_fn, grid_step_fn
from dspark.models import load_model
from step_order_cost import timed  # scripts/: run as a script, its folder is on the path

SHAPES = ((1, 1), (1, 2), (1, 3), (2, 1), (2, 2), (4, 1), (4, 2), (8, 1), (8, 2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--drafter", default="dspark")
    ap.add_argument("--repeats", type=int, default=25)
    ap.add_argument("--out", default=None)
    ap.add_argument("--shapes", default=None, help="R:k,R:k,... (default: %s)" % ",".join(f"{r}:{k}" for r, k in SHAPES))
    args = ap.parse_args()
    shapes = SHAPES if not args.shapes else tuple(tuple(int(x) for x in s.split(":")) for s in args.shapes.split(","))
    model = load_model(args.model, dtype="float32").model
    drafter = make_drafter(args.drafter, target=model, gamma=7)
    step = grid_step_fn(model, _warm_caches(model))
    draft = drafter_step_fn(model, drafter)
    with torch.inference_mode():
        for r, k in shapes:  # warm every shape and every request's drafting state
            draft(r, depth=max(1, k - 1)), step(r, 1), step(r, k)
        times = {(shape, prev): [] for shape in shapes for prev in ("target", "draft")}
        rng = random.Random(0)
        for _ in range(args.repeats):
            jobs = [(shape, prev) for shape in shapes for prev in ("target", "draft")]
            rng.shuffle(jobs)
            for (r, k), prev in jobs:
                if prev == "target":
                    step(r, 1)
                else:
                    draft(r, depth=max(1, k - 1))
                times[(r, k), prev].append(timed(lambda: step(r, k)))
    med = {key: statistics.median(ts) * 1e3 for key, ts in times.items()}
    rows = []
    for r, k in shapes:
        a, b = med[(r, k), "target"], med[(r, k), "draft"]
        row = {"R": r, "k": k, "after target ms": round(a, 2), "after draft ms": round(b, 2),
               "draft / target": round(b / a, 3)}
        if k > 1:  # the engine's order: a verify step after its proposal, a plain step after a plain one
            plain = med[(r, 1), "target"]
            row["verify:plain engine order"] = round(b / plain, 3)
            row["verify:plain both after target"] = round(a / plain, 3)
        rows.append(row)
    headers = list(max(rows, key=len).keys())  # rows with k > 1 carry the verify : plain columns
    table = markdown_table(headers, [[row.get(h, "") for h in headers] for row in rows])
    print(table)
    if args.out:
        write_results(Path(args.out), "after_draft_cost", {"machine": machine_info(), "repeats": args.repeats,
                                                     "rows": rows, "samples_ms": {f"{s}-{p}": [t * 1e3 for t in ts]
                                                                                  for (s, p), ts in times.items()}},
                      table)


if __name__ == "__main__":
    main()
