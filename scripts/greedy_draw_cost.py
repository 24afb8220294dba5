"""The greedy draw and the scatter of the drafter's q, timed against what they replaced (session 46).

    .venv/bin/python scripts/greedy_draw_cost.py --out results/greedy-draw-s46

Greedy draw: torch's CPU argmax against the C kernel (`native_sample.argmax`) over SmolLM2-sized logits — one
request's verify block (8 × 49,152), one row, a drafter slot (16,384), 32 rows — with a row maximum alone (`amax`)
as the floor. Scatter: one request's seven draft-vocabulary slots (16,384 of 49,152 ids) into the full vocabulary,
by `out[..., ids] = q` (index_put, before) and `index_copy_` (now). Medians of `--rounds` rounds of `--calls` calls,
the paths interleaved in each round; both give the same result (checked).
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from dspark.bench.common import machine_info, markdown_table, write_results
from dspark.decoding import native_sample


def timed(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return 1e6 * (time.perf_counter() - t0) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if native_sample.argmax_kernel() is None:
        raise SystemExit("the C argmax did not build here (no compiler or DSPARK_NATIVE=0)")
    g = torch.Generator().manual_seed(0)
    rows = []
    for shape in ((8, 49152), (1, 49152), (1, 16384), (32, 49152)):
        x = torch.randn(*shape, generator=g)
        assert torch.equal(native_sample.argmax(x), x.argmax(-1))
        paths = {"torch argmax": lambda: x.argmax(-1), "C argmax": lambda: native_sample.argmax(x),
                 "amax (floor)": lambda: x.amax(-1)}
        times = {k: [] for k in paths}
        for _ in range(args.rounds + 1):  # the first round warms up
            for k, fn in paths.items():
                times[k].append(timed(fn, args.calls))
        rows.append({"what": f"argmax {shape[0]} x {shape[1]}",
                     **{k: statistics.median(v[1:]) for k, v in times.items()}})
    ids = torch.randperm(49152, generator=g)[:16384].sort().values
    q = torch.rand(1, 7, 16384, generator=g)

    def index_put():
        out = q.new_zeros(1, 7, 49152)
        out[..., ids] = q
        return out

    def index_copy():
        return q.new_zeros(1, 7, 49152).index_copy_(-1, ids, q)

    assert torch.equal(index_put(), index_copy())
    times = {"index_put": [], "index_copy_": []}
    for _ in range(args.rounds + 1):
        times["index_put"].append(timed(index_put, args.calls))
        times["index_copy_"].append(timed(index_copy, args.calls))
    scatter = {k: statistics.median(v[1:]) for k, v in times.items()}
    table = markdown_table(["what", "torch argmax µs", "C argmax µs", "amax (floor) µs"],
                           [[r["what"], f"{r['torch argmax']:.1f}", f"{r['C argmax']:.1f}", f"{r['amax (floor)']:.1f}"]
                            for r in rows])
    table += ("\n\nScatter of one request's 7 draft slots (16,384 ids) into 49,152: "
              f"index_put {scatter['index_put']:.1f} µs, index_copy_ {scatter['index_copy_']:.1f} µs\n")
    title = (f"python scripts/greedy_draw_cost.py {' '.join(f'--{k} {v}' for k, v in vars(args).items() if v is not None)}"
             f"\n\n# The greedy draw and q's scatter, median µs a call ({torch.get_num_threads()} threads)\n\n")
    print(title + table)
    if args.out is not None:
        write_results(args.out, "greedy_draw", {"machine": machine_info(), "argmax": rows, "scatter": scatter},
                      title + table)


if __name__ == "__main__":
    main()
