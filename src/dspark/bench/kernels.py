"""Where a decode step's weight reads go: every projection of one forward through each CPU kernel we have.

Part of `dspark bench runtime`. For 1..8 rows (one decode step of that many requests, or a short verification),
the model's real weights go through plain `F.linear`, oneDNN's pre-packed product and our C kernel
(models/native.py), one after another; the effective read bandwidth (weight bytes / time) shows how close each
comes to the machine's memory bandwidth, which bounds batch-1 decoding.
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from ..models import native
from .common import median

ROWS = (1, 2, 4, 8)


def _projections(model) -> list:
    return [p for layer in model.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)] + [model.lm_head]


def _kernels(projs) -> dict:
    out = {"torch linear": lambda p, x: F.linear(x, p.weight, p.bias)}
    if all(p.packed is not None for p in projs):
        out["oneDNN packed"] = lambda p, x: torch.ops.mkldnn._linear_pointwise(x, p.packed, p.bias, "none", [], "")
    if native.kernel() is not None and all(native.usable(p.weight) for p in projs):
        out["native (ours)"] = lambda p, x: native.linear(x, p.weight, p.bias)
    return out


def projection_kernels(model, repeats: int = 7) -> list[dict]:
    """Median seconds for all projections of one forward, per kernel and row count (the kernels interleaved)."""
    projs = _projections(model)
    nbytes = sum(p.weight.numel() * p.weight.element_size() for p in projs)
    kernels = _kernels(projs)
    rows_out = []
    for rows in ROWS:
        xs = [torch.randn(rows, p.weight.shape[1], dtype=p.weight.dtype) for p in projs]
        times = {name: [] for name in kernels}
        for _ in range(repeats):
            for name, fn in kernels.items():
                t0 = time.perf_counter()
                for p, x in zip(projs, xs):
                    fn(p, x)
                times[name].append(time.perf_counter() - t0)
        for name, ts in times.items():
            s = median(ts[1:])
            rows_out.append({"kernel": name, "rows": rows, "seconds": s, "gb_per_s": nbytes / s / 1e9,
                             "weight_mb": nbytes / 1e6})
            print(f"projections {name:14s} rows={rows}: {s * 1000:6.1f} ms  {nbytes / s / 1e9:5.1f} GB/s", flush=True)
    return rows_out
