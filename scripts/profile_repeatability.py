"""How far two speed profiles of the same machine disagree at low load, where the scheduler's choices are close.

    .venv/bin/python scripts/profile_repeatability.py results/profile-drift-s41/profile-ref-1.json \
        results/profile-drift-s41/profile-ref-2.json

Prints, over the grid cells of at most ``--max-requests`` requests, the mean and largest relative difference
between the two profiles, the mean difference of the steps along each row (what one more verified token costs:
what the scheduler's choice of K reads), and the mean difference of the drafting tables there.
"""
from __future__ import annotations

import argparse
import json

import numpy as np


def _tables(path: str, max_requests: int) -> tuple[np.ndarray, np.ndarray]:
    d = json.load(open(path, encoding="utf-8"))
    rows = [i for i, r in enumerate(d["grid_requests"]) if r <= max_requests]
    grid = 1e3 * np.asarray(d["grid_seconds"])[rows]  # [R, k] ms
    cols = [i for i, r in enumerate(d["draft_requests"]) if r <= max_requests]
    drafting = [d.get("shallow_draft_seconds", []), *d.get("depth_draft_seconds", []), d["draft_seconds"]]
    return grid, 1e3 * np.asarray([np.asarray(t)[cols] for t in drafting if len(t)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("first")
    ap.add_argument("second")
    ap.add_argument("--max-requests", type=int, default=4)
    args = ap.parse_args()
    (ga, da), (gb, db) = _tables(args.first, args.max_requests), _tables(args.second, args.max_requests)
    rel = np.abs(ga - gb) / ((ga + gb) / 2)
    steps = np.abs(np.diff(ga, axis=1) - np.diff(gb, axis=1))
    print(f"grid cells of <= {args.max_requests} requests: mean |difference| {np.abs(ga - gb).mean():.2f} ms, "
          f"mean relative {100 * rel.mean():.1f} %, largest {100 * rel.max():.1f} %; steps along a row differ by "
          f"{steps.mean():.2f} ms on average")
    if da.shape == db.shape:
        print(f"drafting tables there: mean |difference| {np.abs(da - db).mean():.2f} ms")


if __name__ == "__main__":
    main()
