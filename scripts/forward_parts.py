"""Where a target forward's time goes at 1..8 tokens of one request: time by operator, and what more rows add.

    .venv/bin/python scripts/forward_parts.py --dtypes float32,bfloat16 --rows 1,2,8 --out results/forward-parts

One request after a 300-token context (as norm_cost.py), `rows` new tokens, logits for every row (a verify
step). Wall time: median of interleaved plain forwards. Parts: torch.profiler's self CPU time per operator over
`--profiled` forwards, divided per forward; the profiler adds a few µs to each operator, so the parts sum to more
than the wall and are read as shares, not as times. Our C kernels (ctypes calls: projections, attention, norm)
are not torch operators; they show as the time of the Python frames around them, so the script wraps each in a
`record_function` label.
"""
from __future__ import annotations

import argparse
import collections
import statistics
import time
from contextlib import ExitStack
from pathlib import Path
from unittest import mock

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from dspark.bench.common import machine_info, markdown_table, write_results
from dspark.models import layers, load_model, native, native_attention, native_norm
from dspark.models.transformer import Segment

LABELED = ((native, "linear", "projection (C kernel)"),
           (layers.Projection, "packed_linear", "projection (oneDNN packed)"),
           (native_attention, "attend", "attention (C kernel)"),
           (native_norm, "rms_norm", "rms_norm (C kernel)"))


def labelled(stack: ExitStack) -> None:
    """Wrap the calls that leave torch in a named profiler range."""
    for module, name, label in LABELED:
        real = getattr(module, name)

        def wrapper(*args, _real=real, _label=label, **kwargs):  # a plain function: bound as a method too
            with record_function(_label):
                return _real(*args, **kwargs)
        stack.enter_context(mock.patch.object(module, name, wrapper))


def stepper(model, rows: int):
    cache = model.new_cache(capacity=400)
    g = torch.Generator().manual_seed(0)
    model.forward(torch.randint(0, 40_000, (300,), generator=g), [Segment(cache, 0, 300)],
                  logit_rows=torch.tensor([299]))

    def step() -> float:
        cache.truncate(300)
        tokens = torch.randint(0, 40_000, (rows,), generator=g)
        t0 = time.perf_counter()
        model.forward(tokens, [Segment(cache, 300, rows)], logit_rows=torch.arange(rows))
        return time.perf_counter() - t0
    return step


def parts(step, forwards: int) -> dict[str, float]:
    """Self CPU ms per forward by operator (record_function labels count their own span)."""
    with ExitStack() as stack:
        labelled(stack)
        for _ in range(3):
            step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(forwards):
                step()
    spent: dict[str, float] = collections.defaultdict(float)
    for e in prof.key_averages():
        spent[e.key] += e.self_cpu_time_total / 1e3 / forwards
    return spent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--rows", default="1,2,8")
    ap.add_argument("--repeats", type=int, default=40, help="plain forwards per row count for the wall time")
    ap.add_argument("--profiled", type=int, default=20)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    row_counts = [int(r) for r in args.rows.split(",")]
    table = []
    for name in args.dtypes.split(","):
        model = load_model(args.model, dtype=name).model
        steps = {k: stepper(model, k) for k in row_counts}
        walls = collections.defaultdict(list)
        for _ in range(3):
            for s in steps.values():
                s()
        for _ in range(args.repeats):  # interleaved: the VM's drift hits every row count alike
            for k, s in steps.items():
                walls[k].append(s())
        spent = {k: parts(s, args.profiled) for k, s in steps.items()}
        names = set().union(*(spent[k] for k in row_counts))  # the top operators at any row count
        ops = sorted(names, key=lambda op: -max(spent[k].get(op, 0.0) for k in row_counts))[: args.top]
        for op in ops + ["(all operators)"]:
            row = {"dtype": name, "part": op}
            for k in row_counts:
                total = sum(spent[k].values()) if op == "(all operators)" else spent[k].get(op, 0.0)
                row[f"{k} rows ms"] = round(total, 3)
            table.append(row)
        table.append({"dtype": name, "part": "wall (median, unprofiled)",
                      **{f"{k} rows ms": round(statistics.median(walls[k]) * 1e3, 2) for k in row_counts}})
        print(render(table[-(len(ops) + 2):]), flush=True)
    if args.out:
        title = f"# Target forward by operator (`scripts/forward_parts.py --dtypes {args.dtypes} --rows {args.rows}`)"
        data = {"machine": machine_info(), "args": vars(args) | {"out": str(args.out)}, "rows": table}
        write_results(args.out, "forward_parts", data, title + "\n\n" + render(table) + "\n")


def render(rows: list[dict]) -> str:
    return markdown_table(list(rows[0]), [list(r.values()) for r in rows])


if __name__ == "__main__":
    main()
