"""Where one DSpark proposal's time goes: backbone, LM head, Markov steps, confidence head, draws, the rest.

    .venv/bin/python scripts/propose_breakdown.py --requests 1,4 --depths 1,3,7 --temperatures 0,1 \
        --out results/propose-breakdown

Each part is timed by a wrapper around the drafter's own call (no profiler: its per-op hooks would dwarf the
small ones), after a one-token target forward as in an engine step (weights cold), and summed per proposal;
"rest" is the proposal's wall time minus the parts (context gathering, rotary tables, indexing, Python). The
parts run exactly as in `propose`; only the timers are added.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

import dspark.drafters.dspark as dspark_module
from dspark.bench.common import machine_info, markdown_table, write_results
from dspark.drafters import make_drafter
from dspark.models import load_model
from dspark.models.transformer import Segment
from propose_cost import observed_requests

PARTS = ("backbone", "LM head", "Markov steps", "confidence", "draws")


def instrument(drafter, spent: dict) -> None:
    """Wrap each part's call so that its seconds add up in spent[part]."""
    def timed(fn, part):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[part] += time.perf_counter() - t0
        return wrapper

    model = drafter.model
    model.__dict__["draft_states"] = timed(model.draft_states, "backbone")
    drafter.draft_logits = timed(drafter.draft_logits, "LM head")
    if model.head is not None:
        model.head.__dict__["step"] = timed(model.head.step, "Markov steps")
    model.__dict__["confidence_logits"] = timed(model.confidence_logits, "confidence")
    dspark_module.draw = timed(dspark_module.draw, "draws")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--drafter", default="dspark")
    ap.add_argument("--requests", default="1,4")
    ap.add_argument("--depths", default="1,3,7")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--dtype", default="float32", help="the target's dtype (bench serve's --dtype)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    model = load_model(args.model, dtype=args.dtype).model
    drafter = make_drafter(args.drafter, target=model, gamma=7)
    if not hasattr(drafter, "model") or not hasattr(drafter.model, "draft_states"):
        raise SystemExit(f"{args.drafter}: not a DSpark-family drafter, nothing to break down")
    spent = dict.fromkeys(PARTS, 0.0)
    instrument(drafter, spent)
    cache, rows = model.new_cache(64), []
    for temperature in map(float, args.temperatures.split(",")):
        for n in map(int, args.requests.split(",")):
            reqs = observed_requests(model, drafter, n, temperature)
            for depth in map(int, args.depths.split(",")):
                samples = []
                for rep in range(args.repeats + 1):  # the first warms up
                    cache.truncate(0)
                    model.forward(torch.tensor([5]), [Segment(cache, 0, 1)])
                    for part in spent:
                        spent[part] = 0.0
                    t0 = time.perf_counter()
                    drafter.propose(reqs, depth=depth)
                    total = time.perf_counter() - t0
                    if rep:
                        samples.append({"total": total, **spent, "rest": total - sum(spent.values())})
                row = {"temperature": temperature, "requests": n, "depth": depth,
                       **{k: 1000 * statistics.median(s[k] for s in samples) for k in samples[0]}}
                rows.append(row)
                print("  ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()),
                      flush=True)
    md = ("# One proposal's parts, median ms over {} repeats, after a one-token target step\n\n".format(args.repeats)
          + markdown_table(["T", "requests", "depth", "total", *PARTS, "rest"],
                           [[r["temperature"], r["requests"], r["depth"], r["total"], *(r[p] for p in PARTS),
                             r["rest"]] for r in rows]) + "\n")
    print(md)
    if args.out is not None:
        write_results(args.out, "propose_breakdown", {"machine": machine_info(), "args": vars(args) | {
            "out": str(args.out)}, "rows": rows}, md)


if __name__ == "__main__":
    main()
