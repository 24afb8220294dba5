"""What does an RMSNorm cost, torch's composite against the C kernel (models/native_norm.py), alone and inside a
SmolLM2-135M forward?

    .venv/bin/python scripts/norm_cost.py [--dtypes float32,bfloat16] [--rows 1,2,8,16,32,512] [--repeats 7]
        [--out DIR]

Alone: one call on [rows, 576] (the model's width), mean µs over 2,000 calls, median over repeats. In a forward
(rows ≤ 32; 512 rows is a prompt chunk, timed alone only): the target's step of `rows` tokens after a 300-token
context, with the kernel on and off (layers.rms_norm's choice patched), interleaved call by call so that drift hits
both alike; median ms over repeats × 10 steps.
Writes norm_cost.json and norm_cost.md.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F

from dspark.bench.common import machine_info, markdown_table, write_results
from dspark.models import load_model, native_norm
from forward_parts import stepper


def per_call_us(fn, calls: int = 2000) -> float:
    for _ in range(100):
        fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def alone(dtype: torch.dtype, rows: int, repeats: int) -> dict:
    g = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 576, generator=g).to(dtype), torch.randn(576, generator=g).to(dtype)
    ours = statistics.median(per_call_us(lambda: native_norm.rms_norm(x, w, 1e-5)) for _ in range(repeats))
    ref = statistics.median(per_call_us(lambda: F.rms_norm(x, (576,), w, 1e-5)) for _ in range(repeats))
    return {"torch_us": round(ref, 2), "kernel_us": round(ours, 2), "torch / kernel": round(ref / ours, 2)}


FORWARD_KEYS = ("forward_torch_ms", "forward_kernel_ms", "forward torch / kernel")


def in_forward(model, rows: int, repeats: int) -> dict:
    step = stepper(model, rows)
    times = {True: [], False: []}
    for _ in range(3):
        step()
    for _ in range(repeats * 10):
        for on in (True, False):
            with mock.patch.object(native_norm, "usable", native_norm.usable if on else lambda x, w: False):
                times[on].append(step())
    on, off = (statistics.median(times[k]) * 1e3 for k in (True, False))
    return {"forward_torch_ms": round(off, 2), "forward_kernel_ms": round(on, 2), "forward torch / kernel":
            round(off / on, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--rows", default="1,2,8,16,32,512")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if native_norm.kernels() is None:
        raise SystemExit("the C norm kernel is not available here (no compiler, or DSPARK_NATIVE=0)")
    rows_out = []
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        model = load_model("smollm2-135m-instruct", dtype=name).model
        for rows in (int(r) for r in args.rows.split(",")):
            forward = in_forward(model, rows, args.repeats) if rows <= 32 else dict.fromkeys(FORWARD_KEYS, "–")
            row = {"dtype": name, "rows": rows, **alone(dtype, rows, args.repeats), **forward}
            rows_out.append(row)
            print(row, flush=True)
    table = markdown_table(list(rows_out[0]), [list(r.values()) for r in rows_out])
    print(table)
    if args.out:
        write_results(args.out, "norm_cost", {"settings": vars(args) | {"out": str(args.out)},
                                              "machine": machine_info(), "rows": rows_out},
                      f"# RMSNorm: torch vs the C kernel (`scripts/norm_cost.py --dtypes {args.dtypes} --rows "
                      f"{args.rows} --repeats {args.repeats}`)\n\n{table}\n")


if __name__ == "__main__":
    main()
