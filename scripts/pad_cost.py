"""A target forward of a few tokens with and without the oneDNN padding kernel_choice measured, interleaved.

    .venv/bin/python scripts/pad_cost.py --dtypes bfloat16,float32 --rows 1,2,3,4 --out results/pad-cost-s38

One request after a 300-token context, `rows` new tokens with logits for each (scripts/forward_parts.py's step).
Each round runs every row count unpadded and then with the measured padding (`Projection.pad_to`), so the VM's
drift hits both alike; medians over the rounds. Rows the C kernel serves (fp32, up to its measured limit) are not
padded either way, so fp32 shows the padding only above that limit.
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from dspark.bench.common import machine_info, write_results
from dspark.models import kernel_choice, load_model
from forward_parts import render, stepper


def compare(model, row_counts: list[int], rounds: int) -> list[dict]:
    projs = kernel_choice.projections(model)
    measured = dict(model.lm_head.pad_to)
    steps = {k: stepper(model, k) for k in row_counts}
    times = {(k, padded): [] for k in row_counts for padded in (False, True)}
    for i in range(rounds + 3):  # three warm-up rounds
        for padded in (False, True):
            for p in projs:
                p.pad_to = dict(measured) if padded else {}
            for k, step in steps.items():
                seconds = step()
                if i >= 3:
                    times[(k, padded)].append(seconds)
    for p in projs:
        p.pad_to = dict(measured)
    rows = []
    for k in row_counts:
        off, on = (statistics.median(times[(k, padded)]) * 1e3 for padded in (False, True))
        rows.append({"rows": k, "padded to": measured.get(k, "-"), "unpadded ms": round(off, 2),
                     "padded ms": round(on, 2), "unpadded / padded": round(off / on, 3)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--rows", default="1,2,3,4")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    table = []
    for name in args.dtypes.split(","):
        model = load_model(args.model, dtype=name).model
        native_rows = model.lm_head.native_rows if model.lm_head.native else None
        for row in compare(model, [int(r) for r in args.rows.split(",")], args.rounds):
            table.append({"dtype": name, "C kernel rows": native_rows if native_rows is not None else "-", **row})
    text = render(table)
    print(text)
    if args.out:
        cmd = f"`scripts/pad_cost.py --dtypes {args.dtypes} --rows {args.rows} --rounds {args.rounds}`"
        write_results(args.out, "pad_cost", {"machine": machine_info(), "args": vars(args) | {"out": str(args.out)},
                                             "rows": table},
                      f"# A forward with and without oneDNN's measured padding ({cmd})\n\n{text}\n")


if __name__ == "__main__":
    main()
