"""Where a decode step's weight reads go: every projection of one forward through each CPU kernel we have.

Part of `dspark bench runtime`. For 1..8 rows (one decode step of that many requests, or a short verification),
the model's real weights go through plain `F.linear`, oneDNN's pre-packed product and our C kernel
(models/native.py), one after another; the effective read bandwidth (weight bytes / time) shows how close each
comes to the machine's memory bandwidth, which bounds batch-1 decoding. Alone (the crossover between the kernels
moves with the VM's phase, and this table is the quick way to see where it is):

    .venv/bin/python -m dspark.bench.kernels --rows 1,2,3,4,8 --out results/kernels-s19
    .venv/bin/python -m dspark.bench.kernels --dtype bfloat16 --rows 1,2,4,8,16  # ours too where AVX512-BF16

`--compare-source FILE.c` adds another build of `dspark_linear` (e.g. an earlier version from git, built with the
flags it was built with then) to the same interleaved rounds, so two versions of our kernel meet in one run.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ..models import native
from ..models.kernel_choice import projections
from .common import machine_info, markdown_table, median, write_results

ROWS = (1, 2, 4, 8)


def _run_c(fn, p, x):
    y = torch.empty(x.shape[0], p.weight.shape[0])
    fn(x.data_ptr(), x.shape[0], p.weight.data_ptr(), None if p.bias is None else p.bias.data_ptr(),
       p.weight.shape[0], p.weight.shape[1], y.data_ptr(), torch.get_num_threads())
    return y


def _compare_kernel(source: str):
    """`dspark_linear` from another source file, built with the base flag sets only (no per-source extras)."""
    fn = native.load_function(Path(source), "dspark_linear") if Path(source).is_file() else None
    if fn is None:
        raise SystemExit(f"could not build or load dspark_linear from {source}")
    fn.argtypes, fn.restype = native.kernel().argtypes, None
    return lambda p, x: _run_c(fn, p, x)


def _kernels(projs, compare: str | None = None) -> dict:
    out = {"torch linear": lambda p, x: F.linear(x, p.weight, p.bias)}
    if all(p.packed is not None for p in projs):
        out["oneDNN packed"] = lambda p, x: torch.ops.mkldnn._linear_pointwise(x, p.packed, p.bias, "none", [], "")
        if any(p.pad_to for p in projs):  # the rows kernel_choice pads, padded as the engine runs them
            out["oneDNN as padded"] = lambda p, x: p.packed_linear(x)
    if all(native.usable(p.weight) for p in projs):
        out["native (ours)"] = lambda p, x: native.linear(x, p.weight, p.bias)
        if compare:
            out[f"native ({Path(compare).stem})"] = _compare_kernel(compare)
    return out


def projection_kernels(model, repeats: int = 7, rows: tuple[int, ...] = ROWS, compare: str | None = None) -> list[dict]:
    """Median seconds for all projections of one forward, per kernel and row count (the kernels interleaved)."""
    projs = projections(model)
    nbytes = sum(p.weight.numel() * p.weight.element_size() for p in projs)
    kernels = _kernels(projs, compare)
    rows_out = []
    for n_rows in rows:
        xs = [torch.randn(n_rows, p.weight.shape[1], dtype=p.weight.dtype) for p in projs]
        times = {name: [] for name in kernels}
        for _ in range(repeats):
            for name, fn in kernels.items():
                t0 = time.perf_counter()
                for p, x in zip(projs, xs):
                    fn(p, x)
                times[name].append(time.perf_counter() - t0)
        for name, ts in times.items():
            s = median(ts[1:])
            rows_out.append({"kernel": name, "rows": n_rows, "seconds": s, "gb_per_s": nbytes / s / 1e9,
                             "weight_mb": nbytes / 1e6})
            print(f"projections {name:24s} rows={n_rows}: {s * 1000:6.1f} ms  {nbytes / s / 1e9:5.1f} GB/s", flush=True)
    return rows_out


def main(argv: list[str] | None = None) -> None:
    import argparse

    from ..models.loader import load_model

    ap = argparse.ArgumentParser(description="every projection of one forward through each CPU kernel")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)), help="row counts, comma-separated")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=None, help="directory for kernels.json and kernels.md")
    ap.add_argument("--compare-source", default=None, help="another native_linear.c to time beside ours (fp32)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the weights' dtype")
    args = ap.parse_args(argv)
    rows = tuple(int(r) for r in args.rows.split(","))
    if not rows or min(rows) < 1:
        ap.error(f"--rows needs positive row counts, got {args.rows!r}")
    if args.compare_source and args.dtype != "float32":
        ap.error("--compare-source times fp32 builds only")
    model = load_model(args.model, dtype=args.dtype).model
    results = projection_kernels(model, repeats=args.repeats, rows=rows, compare=args.compare_source)
    if args.out:
        table = markdown_table(["kernel", "rows", "ms", "GB/s"], [[r["kernel"], r["rows"], 1e3 * r["seconds"],
                                                                   r["gb_per_s"]] for r in results])
        write_results(Path(args.out), "kernels", {"machine": machine_info(), "model": args.model, "dtype": args.dtype,
                                                  "compare_source": args.compare_source, "results": results},
                      table + "\n")


if __name__ == "__main__":
    main()
