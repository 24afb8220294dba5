"""What padding rows to a oneDNN bucket costs: target steps under the session-23 buckets and the current ones.

    .venv/bin/python scripts/bucket_cost.py --out results/buckets-s24
    .venv/bin/python scripts/bucket_cost.py --steps 32x1,34x1 --prefills 140+8 --rounds 5
    .venv/bin/python scripts/bucket_cost.py --rss --out results/buckets-s24

The packed projections pad their rows up to `layers.bucket_rows` (a bounded set of shapes keeps oneDNN's
primitive cache, and so resident memory, bounded). Until session 24 the buckets were 16 rows wide from 33 rows and
128 wide from 129: a decode step of 32 requests with two drafts (34 rows) ran as 48 rows, and a prefill step of a
140-token prompt as 256. This times the same forwards under both rules, interleaved in shuffled rounds (the
machine's drifting speed hits both alike): verify steps of R requests with k tokens each (`RxK`) and prefill
steps of one P-token prompt chunk beside R one-token rows (`P+R`), as the engine fuses them. `--rss` measures the
price of more sizes instead: resident memory after one forward at every size of each rule up to 1,024 rows, each
rule in a fresh process.
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from dspark.bench.common import machine_info, write_results
from dspark.engine.profiling import _step_fn, _warm_caches, prefill_step_fn
from dspark.models import layers, load_model
from dspark.models.transformer import Segment

STEPS = "16x1,32x1,30x1+2x3,34x1,40x1,52x1,16x3"
PREFILLS = "140+8,200+8,300+16,420+4,500+32"


def coarse_buckets(rows: int) -> int:
    """The rule before session 24: 4 wide up to 32 rows, 16 up to 128, then 128."""
    if rows <= 8:
        return rows
    step = 4 if rows <= 32 else 16 if rows <= 128 else 128
    return -(-rows // step) * step


def _parts(spec: str) -> list[int]:
    """'30x1+2x3' -> [1] * 30 + [3] * 2: tokens each request verifies."""
    parts = []
    for term in spec.split("+"):
        r, k = (int(x) for x in term.split("x"))
        parts += [k] * r
    return parts


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS"))


def rss_of(model_name: str, rule: str) -> dict:
    """In this process: resident memory before and after one forward at each of the rule's sizes up to 1,024."""
    fn = coarse_buckets if rule == "coarse" else layers.bucket_rows
    layers.bucket_rows = fn
    model = load_model(model_name).model
    cache = model.new_cache(1100)

    def forward(n: int) -> None:
        model.forward(torch.zeros(n, dtype=torch.long), [Segment(cache, 0, n)], logit_rows=torch.tensor([n - 1]))
        cache.truncate(0)

    forward(1)
    forward(600)  # one large forward first: the allocator's own growth is not the buckets'
    before = _rss_mb()
    sizes = sorted({fn(n) for n in range(1, 1025)})
    for n in sizes:
        forward(n)
    return {"rule": rule, "sizes": len(sizes), "rss_before_mb": round(before), "rss_after_mb": round(_rss_mb())}


def rss_table(model_name: str) -> str:
    rows = []
    for rule in ("coarse", "current"):
        out = subprocess.run([sys.executable, __file__, "--model", model_name, "--rss-of", rule], check=True,
                             capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    return ("| rule | sizes up to 1,024 rows | RSS before | RSS after one forward at each | grown |\n|---|---|---|---|---|\n"
            + "".join(f"| {r['rule']} | {r['sizes']} | {r['rss_before_mb']} MB | {r['rss_after_mb']} MB | "
                      f"+{r['rss_after_mb'] - r['rss_before_mb']} MB |\n" for r in rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--steps", default=STEPS, help="verify steps: RxK terms joined by '+', comma-separated")
    ap.add_argument("--prefills", default=PREFILLS, help="prefill steps: P+R pairs, comma-separated")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--out", default=None, help="directory for buckets.json and buckets.md")
    ap.add_argument("--rss", action="store_true", help="resident memory of each rule's sizes (rss.md in --out)")
    ap.add_argument("--rss-of", default=None, choices=("coarse", "current"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rss_of:
        print(json.dumps(rss_of(args.model, args.rss_of)))
        return
    if args.rss:
        table = rss_table(args.model)
        print(table)
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "rss.md").write_text(f"# Resident memory of the row buckets ({args.model}, "
                                                    f"{time.strftime('%Y-%m-%d %H:%M')})\n\n{table}")
        return
    model = load_model(args.model).model
    caches = _warm_caches(model)
    step, prefill = _step_fn(model, caches), prefill_step_fn(model, caches)
    jobs = {f"step {s}": (lambda p=_parts(s): step(p), sum(_parts(s))) for s in args.steps.split(",") if s}
    for spec in (s for s in args.prefills.split(",") if s):
        p, r = (int(x) for x in spec.split("+"))
        jobs[f"prefill {spec}"] = (lambda p=p, r=r: prefill(p, r), p + r)
    rules = {"coarse": coarse_buckets, "current": layers.bucket_rows}
    cells = [(name, rule) for name in jobs for rule in rules]
    times: dict[tuple[str, str], list[float]] = {c: [] for c in cells}
    rng = random.Random(0)
    try:
        for i in range(args.rounds + 1):  # round 0 warms every shape up and is not recorded
            for name, rule in rng.sample(cells, len(cells)):
                layers.bucket_rows = rules[rule]
                t0 = time.perf_counter()
                jobs[name][0]()
                if i:
                    times[(name, rule)].append(time.perf_counter() - t0)
    finally:
        layers.bucket_rows = rules["current"]
    rows = []
    for name, (_, n) in jobs.items():
        old, new = (float(np.median(times[(name, r)])) for r in rules)
        rows.append({"shape": name, "rows": n, "coarse_rows": coarse_buckets(n), "current_rows": rules["current"](n),
                     "coarse_ms": round(old * 1e3, 2), "current_ms": round(new * 1e3, 2), "ratio": round(new / old, 3)})
    header = ("| shape | rows | padded (coarse → current) | coarse ms | current ms | current / coarse |\n"
              "|---|---|---|---|---|---|\n")
    table = header + "".join(f"| {r['shape']} | {r['rows']} | {r['coarse_rows']} → {r['current_rows']} | "
                             f"{r['coarse_ms']:.1f} | {r['current_ms']:.1f} | {r['ratio']:.3f} |\n" for r in rows)
    meta = {"model": args.model, "rounds": args.rounds, **machine_info()}
    print(f"medians of {args.rounds} shuffled rounds: {json.dumps(meta)}\n\n{table}")
    if args.out:
        write_results(Path(args.out), "buckets", {"settings": meta, "results": rows},
                      f"# Row buckets: coarse (before session 24) vs current\n\n{json.dumps(meta)}\n\n{table}")


if __name__ == "__main__":
    main()
