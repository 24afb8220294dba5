"""A target forward of a few tokens in fp32 and in bf16, with and without the bf16 C kernel, interleaved.

    .venv/bin/python scripts/dtype_forward_cost.py --rows 1,2,4,8 --out results/bf16-avx2-s53

Until session 53 the bf16 C projection kernel needed AVX512-BF16, so on an AVX2-only CPU a bf16 target ran
every projection through torch and the fp32 target was the faster one. The kernel now widens bf16 pairs with two
integer ops where the CPU has no bf16 dot products. This times, in one process and round by round so the VM's
drift hits every arm alike: the fp32 target and the bf16 target each with the routes kernel_choice measured on
this machine, and the bf16 target with our C kernel switched off (every row through torch / oneDNN, i.e. the bf16
target as it ran here before). One request after a 300-token context, `rows` new tokens with logits for each
(scripts/forward_parts.py's step); medians over the rounds.
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from dspark.bench.common import machine_info, write_results
from dspark.models import kernel_choice, load_model
from dspark.models import native
from forward_parts import render, stepper

ARMS = ("fp32", "bf16, C kernel", "bf16, torch only")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if native.kernel_bf16() is None:
        raise SystemExit("no bf16 C kernel on this CPU/compiler: nothing to compare")
    rows = [int(r) for r in args.rows.split(",")]
    fp32, bf16 = (load_model(args.model, dtype=d).model for d in ("float32", "bfloat16"))
    projs = kernel_choice.projections(bf16)
    measured = [p.native_rows for p in projs]

    def c_kernel(on: bool) -> None:
        for p, limit in zip(projs, measured):
            p.native_rows = limit if on else 0

    steps = {(arm, k): stepper(fp32 if arm == ARMS[0] else bf16, k) for arm in ARMS for k in rows}
    times = {key: [] for key in steps}
    for i in range(args.rounds + 3):  # three warm-up rounds
        for arm in ARMS:
            c_kernel(arm != ARMS[2])
            for k in rows:
                seconds = steps[(arm, k)]()
                if i >= 3:
                    times[(arm, k)].append(seconds)
    c_kernel(True)
    table = []
    for k in rows:
        ms = {arm: statistics.median(times[(arm, k)]) * 1e3 for arm in ARMS}
        table.append({"rows": k, "bf16 C kernel rows": bf16.lm_head.native_rows,
                      **{f"{arm} ms": round(v, 2) for arm, v in ms.items()},
                      "fp32 / bf16 C": round(ms[ARMS[0]] / ms[ARMS[1]], 3),
                      "bf16 torch / bf16 C": round(ms[ARMS[2]] / ms[ARMS[1]], 3)})
    text = render(table)
    print(text)
    if args.out:
        cmd = f"`scripts/dtype_forward_cost.py --rows {args.rows} --rounds {args.rounds}`"
        write_results(args.out, "dtype_forward_cost", {"machine": machine_info(),
                                                        "args": vars(args) | {"out": str(args.out)}, "rows": table},
                      f"# A target forward in fp32 and bf16, with and without the bf16 C kernel ({cmd})\n\n{text}\n")


if __name__ == "__main__":
    main()
