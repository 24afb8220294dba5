"""The C projection kernel built with and without its W prefetch, fp32 and bf16, on SmolLM2-135M's shapes.

    .venv/bin/python scripts/linear_prefetch_cost.py --out results/bf16-avx2-s53

A block of the one-row path reads 16 W rows at once, each a short stream (576 values: 18 cache lines in bf16),
so the hardware prefetcher catches each only after it has begun; the kernel can fetch the rows after a block
(or a tile) ahead while it runs (native_linear.c, `DSPARK_PREFETCH`). Builds compared: 0 (no prefetch), 1 (bf16
only: the default), 2 (fp32 too). Each product runs through every build in turn, round by round, with a 64 MiB
buffer written between calls so the weights come from memory as in a decode step; medians. bf16 needs the bf16
entry (AVX512-BF16 or AVX2).
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from dspark.bench.common import machine_info, markdown_table, write_results
from dspark.models import native

SHAPES = (("LM head", 49152, 576), ("gate_up", 3072, 576), ("qkv", 960, 576), ("down", 576, 1536))
BUILDS = (0, 1, 2)


def build(prefetch: int) -> dict:
    lib = native.load_library(native.SOURCE, extra_flags=native.CFLAGS + (f"-DDSPARK_PREFETCH={prefetch}",))
    if lib is None or not lib.dspark_linear_bf16_supported():
        raise SystemExit("the kernel did not build, or this CPU has no bf16 entry (AVX512-BF16 or AVX2)")
    fns = {torch.float32: lib.dspark_linear, torch.bfloat16: lib.dspark_linear_bf16}
    for fn in fns.values():
        fn.argtypes, fn.restype = native._ARGTYPES, None
    return fns


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--repeats", type=int, default=25)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(2)
    builds = {b: build(b) for b in BUILDS}
    flush = torch.randn(64 * 2**20 // 4)
    table = []
    for m in (int(r) for r in args.rows.split(",")):
        for name, n, k in SHAPES:
            for dtype in (torch.float32, torch.bfloat16):
                x, w, y = torch.randn(m, k).to(dtype), torch.randn(n, k).to(dtype), torch.empty(m, n, dtype=dtype)
                times = {b: [] for b in BUILDS}
                for i in range(args.repeats + 1):
                    for b in BUILDS:
                        flush.add_(1.0)
                        t0 = time.perf_counter()
                        builds[b][dtype](x.data_ptr(), m, w.data_ptr(), None, n, k, y.data_ptr(), 2)
                        if i:
                            times[b].append(time.perf_counter() - t0)
                ms = {b: statistics.median(t) * 1e3 for b, t in times.items()}
                gbs = n * k * x.element_size() / (ms[1] * 1e-3) / 1e9
                table.append({"rows": m, "product": f"{name} {n}x{k}", "dtype": str(dtype).split(".")[1],
                              "no prefetch ms": round(ms[0], 3), "bf16 prefetch (default) ms": round(ms[1], 3),
                              "all prefetch ms": round(ms[2], 3), "default GB/s": round(gbs, 1),
                              "no prefetch / default": round(ms[0] / ms[1], 3),
                              "all / default": round(ms[2] / ms[1], 3)})
    text = markdown_table(list(table[0]), [list(r.values()) for r in table])
    print(text)
    if args.out:
        cmd = f"`scripts/linear_prefetch_cost.py --rows {args.rows} --repeats {args.repeats}`"
        write_results(args.out, "linear_prefetch_cost", {"machine": machine_info(), "args": vars(args) | {
            "out": str(args.out)}, "rows": table}, f"# The C projection kernel with and without prefetch ({cmd})\n\n"
                      f"{text}\n")


if __name__ == "__main__":
    main()
