"""The C ragged-attention kernel alone, on SmolLM2's shapes: ours against another build of it (e.g. from git).

    git show HEAD~1:src/dspark/models/native_attention.c > /tmp/native_attention_old.c
    .venv/bin/python scripts/attention_kernel_cost.py --compare-source /tmp/native_attention_old.c \
        --out results/attention-kernel-sXX

One call per layer in a target forward; this times one call (9 query heads over 3 KV heads, head size 64) for
`segments x queries x context` shapes: a one-token decode step, a two-token step, an 8-token verification block,
16 one-token requests. Builds are interleaved over shuffled rounds (medians), and each build's output is compared
with the other's (their largest difference is printed: a changed summation order moves results by rounding).
`--forward` times whole SmolLM2 forwards instead (one request after a 300-token context, `rows` new tokens; or
16 such requests of one token each), every build in turn within each round.
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch

from dspark.bench.common import machine_info, markdown_table, shuffled_medians, write_results
from dspark.models import Segment, load_model, native, native_attention
from forward_parts import stepper

H, KV_H, HD = 9, 3, 64


class Cache:  # what segment_table reads: k, v [L, kvH, cap, hd] and the capacity
    def __init__(self, context: int, queries: int, dtype: torch.dtype, g: torch.Generator):
        cap = context + queries
        self.k, self.v = (torch.randn(1, KV_H, cap, HD, generator=g).to(dtype) for _ in "kv")
        self.capacity = cap


def build(source: Path | None, flags: tuple[str, ...] = ()):
    fn = native_attention.kernel() if source is None else native.load_function(
        source, "dspark_ragged_attention", extra_flags=flags)
    if fn is None:
        raise SystemExit(f"could not build {source or native_attention.SOURCE}")
    fn.argtypes, fn.restype = native_attention._ARGTYPES, ctypes.c_int
    return fn


def case(segments: int, queries: int, context: int, dtype: torch.dtype, seed: int = 0):
    """q, k, v, the segment table, and the caches it points into (keep them alive while the table is used)."""
    g = torch.Generator().manual_seed(seed)
    caches = [Cache(context, queries, dtype, g) for _ in range(segments)]
    n = segments * queries
    q = torch.randn(n, H, HD, generator=g).to(dtype)
    k, v = (torch.randn(n, KV_H, HD, generator=g).to(dtype) for _ in "kv")
    table = native_attention.segment_table(caches, [s * queries for s in range(segments)], [context] * segments,
                                           [queries] * segments)
    return q, k, v, table, caches


def many_stepper(model, requests: int):
    """One-token steps of `requests` requests, each after its own 300-token context."""
    g = torch.Generator().manual_seed(0)
    caches = [model.new_cache(capacity=320) for _ in range(requests)]
    for cache in caches:
        model.forward(torch.randint(0, 40_000, (300,), generator=g), [Segment(cache, 0, 300)],
                      logit_rows=torch.tensor([299]))

    def step() -> float:
        for cache in caches:
            cache.truncate(300)
        tokens = torch.randint(0, 40_000, (requests,), generator=g)
        t0 = time.perf_counter()
        model.forward(tokens, [Segment(c, 300, 1) for c in caches], logit_rows=torch.arange(requests))
        return time.perf_counter() - t0
    return step


def forwards(builds: dict, dtypes: list[str], shapes: list[str], rounds: int) -> list[dict]:
    """Median ms of SmolLM2 forwards with each build; shapes are "R" one-token requests or "1xN" N tokens."""
    rows = []
    for dtype in dtypes:
        model = load_model("smollm2-135m-instruct", dtype=dtype).model
        steps = {shape: many_stepper(model, int(shape)) if "x" not in shape else stepper(model, int(shape[2:]))
                 for shape in shapes}
        times = {(shape, name): [] for shape in shapes for name in builds}
        for i in range(rounds + 2):  # two warm-up rounds
            for name, fn in builds.items():
                with mock.patch.object(native_attention, "kernel", lambda *a, fn=fn: fn):
                    for shape, step in steps.items():
                        seconds = step()
                        if i >= 2:
                            times[(shape, name)].append(seconds)
        for shape in shapes:
            ms = {name: 1e3 * statistics.median(times[(shape, name)]) for name in builds}
            row = {"dtype": dtype, "forward": shape, **{f"{n} ms": ms[n] for n in builds}}
            if len(builds) > 1:
                row["speedup"] = ms[next(n for n in builds if n != "ours")] / ms["ours"]
            rows.append(row)
            print(row, flush=True)
    return rows


def layer_calls(builds: dict, dtypes: list[str], shapes: list[str], calls: int, rounds: int) -> list[dict]:
    """Median ms of one layer's call with each build, and the largest difference of its output from ours."""
    rows = []
    for dtype in (getattr(torch, d) for d in dtypes):
        for shape in shapes:
            q, k, v, table, _caches = case(*(int(x) for x in shape.split("x")), dtype)
            outs = {name: torch.empty_like(q) for name in builds}

            def runner(name):
                def run():
                    for _ in range(calls):
                        native_attention.attend(builds[name], q, k, v, outs[name], table, 0, None, HD ** -0.5, None)
                return run
            medians = shuffled_medians({name: runner(name) for name in builds}, rounds=rounds)
            ms = {name: 1e3 * s / calls for name, s in medians.items()}
            diff = max((outs[a].float() - outs["ours"].float()).abs().max().item() for a in builds)
            row = {"dtype": str(dtype).removeprefix("torch."), "shape": shape, **{f"{n} ms": ms[n] for n in builds},
                   "max |diff|": diff}
            if len(builds) > 1:
                row["speedup"] = ms[next(n for n in builds if n != "ours")] / ms["ours"]
            rows.append(row)
            print(row, flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="1x1x300,1x2x300,1x8x300,1x8x1000,16x1x300",
                    help="segments x queries x context, comma-separated")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--compare-source", type=Path, default=None, help="another native_attention.c to time beside ours")
    ap.add_argument("--compare-flags", default="", help="extra compiler flags for that build (space-separated)")
    ap.add_argument("--calls", type=int, default=30, help="calls per timed sample")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--forward", default=None, help='time SmolLM2 forwards instead: e.g. "1x1,1x2,1x8,16"')
    ap.add_argument("--threads", type=int, default=2, help="torch (and so kernel) threads, at most the machine's")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(min(args.threads, torch.get_num_threads()))
    builds = {"ours": build(None)}
    if args.compare_source:
        builds[args.compare_source.stem] = build(args.compare_source, tuple(args.compare_flags.split()))
    data = {"machine": machine_info(), "args": {k: str(v) for k, v in vars(args).items()}}
    if args.forward:
        rows = forwards(builds, args.dtypes.split(","), args.forward.split(","), args.rounds)
        name, title = "attention_forward", "SmolLM2 forwards by attention build (`--forward`), median ms"
    else:
        rows = layer_calls(builds, args.dtypes.split(","), args.shapes.split(","), args.calls, args.rounds)
        name, title = "attention_kernel", "One layer of ragged attention, median ms a call"
    md = (f"# {title} (`scripts/attention_kernel_cost.py`)\n\n"
          + markdown_table(list(rows[0]), [list(r.values()) for r in rows]) + "\n")
    print(md)
    if args.out:
        write_results(args.out, name, data | {"rows": rows}, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
