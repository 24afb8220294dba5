"""A target forward of a few tokens with and without one of the routes kernel_choice measured, interleaved.

    .venv/bin/python scripts/pad_cost.py --dtypes bfloat16,float32 --rows 1,2,3,4 --out results/pad-cost-s38
    .venv/bin/python scripts/pad_cost.py --toggle native --dtypes bfloat16 --rows 1,2 --out results/native-cost-s39

`--toggle padding` (the default): oneDNN's measured padding against none. `--toggle native`: our C kernel up to
its measured row limit against oneDNN's measured routes only (limit 0).

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


def compare(model, row_counts: list[int], rounds: int, toggle: str = "padding") -> list[dict]:
    projs = kernel_choice.projections(model)
    measured = {"padding": dict(model.lm_head.pad_to), "native": model.lm_head.native_rows}[toggle]

    def route(on: bool) -> None:
        for p in projs:
            if toggle == "padding":
                p.pad_to = dict(measured) if on else {}
            else:
                p.native_rows = measured if on else 0
    steps = {k: stepper(model, k) for k in row_counts}
    times = {(k, on): [] for k in row_counts for on in (False, True)}
    for i in range(rounds + 3):  # three warm-up rounds
        for on in (False, True):
            route(on)
            for k, step in steps.items():
                seconds = step()
                if i >= 3:
                    times[(k, on)].append(seconds)
    route(True)
    names = {"padding": ("unpadded", "padded"), "native": ("oneDNN", "with C kernel")}[toggle]
    rows = []
    for k in row_counts:
        off, on = (statistics.median(times[(k, on)]) * 1e3 for on in (False, True))
        first = {"padded to": measured.get(k, "-")} if toggle == "padding" else {"C kernel rows": measured}
        rows.append({"rows": k, **first, f"{names[0]} ms": round(off, 2), f"{names[1]} ms": round(on, 2),
                     f"{names[0]} / {names[1]}": round(off / on, 3)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--rows", default="1,2,3,4")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--toggle", choices=("padding", "native"), default="padding")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    table = []
    for name in args.dtypes.split(","):
        model = load_model(args.model, dtype=name).model
        native_rows = model.lm_head.native_rows if model.lm_head.native else None
        if args.toggle == "native" and native_rows is None:
            raise SystemExit(f"{name}: our C kernel serves no projection here, nothing to toggle")
        for row in compare(model, [int(r) for r in args.rows.split(",")], args.rounds, args.toggle):
            first = {} if args.toggle == "native" else {
                "C kernel rows": native_rows if native_rows is not None else "-"}
            table.append({"dtype": name, **first, **row})
    text = render(table)
    print(text)
    if args.out:
        cmd = (f"`scripts/pad_cost.py --toggle {args.toggle} --dtypes {args.dtypes} --rows {args.rows} "
               f"--rounds {args.rounds}`")
        what = {"padding": "oneDNN's measured padding", "native": "our C kernel"}[args.toggle]
        write_results(args.out, f"{args.toggle}_cost", {"machine": machine_info(),
                                                         "args": vars(args) | {"out": str(args.out)}, "rows": table},
                      f"# A forward with and without {what} ({cmd})\n\n{text}\n")


if __name__ == "__main__":
    main()
