"""What a small torch call costs right after a target forward, against the same call repeated at once.

    PYTHONPATH=src .venv/bin/python scripts/post_forward_op_cost.py --out results/post-forward-ops-s48

After each 8-token forward of the bf16 target (at 290 cached tokens, as a batch-1 verify step) it times, one by one,
the greedy acceptance rule in the tensor form verification used before session 48 (the C argmax of the 8 rows, then
~12 small calls on [1, 7] tensors), then the same sequence again straight away. The first pass pays for whatever
the forward evicted (caches, branch predictors, the dispatcher's paths); the second shows the calls' own cost.
Medians over `--rounds` forwards.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from dspark.bench.common import machine_info, markdown_table, write_results
from dspark.decoding.sampling import greedy_tokens
from dspark.engine.speculative import TransformerTarget
from dspark.models import load_model

STEPS = ("argmax (C)", "arange", "== & <", "cumprod + sum", "isin", "& + any", "where", "cumprod (stops)",
         "index", "where (next)")


def accept_rule(logits: torch.Tensor, drafts: torch.Tensor, num: torch.Tensor, stop_ids: torch.Tensor) -> list[float]:
    """The tensor form of the greedy acceptance rule, each call timed: seconds per step of STEPS."""
    t = [time.perf_counter()]
    best = greedy_tokens(logits)
    t.append(time.perf_counter())
    slots = torch.arange(drafts.shape[1])
    t.append(time.perf_counter())
    ok = (best[:, :-1] == drafts) & (slots < num.unsqueeze(1))
    t.append(time.perf_counter())
    accepted = ok.long().cumprod(-1).sum(-1)
    t.append(time.perf_counter())
    stop = torch.isin(drafts, stop_ids)
    t.append(time.perf_counter())
    hit = stop & (slots < accepted.unsqueeze(1))
    stopped = hit.any(-1)
    t.append(time.perf_counter())
    accepted = torch.where(stopped, accepted, accepted)
    t.append(time.perf_counter())
    first = (~hit).long().cumprod(-1).sum(-1)
    t.append(time.perf_counter())
    token = best[torch.arange(1), accepted]
    t.append(time.perf_counter())
    torch.where(stopped, torch.full_like(token, -1), token + 0 * first)
    t.append(time.perf_counter())
    return [b - a for a, b in zip(t, t[1:])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    target = TransformerTarget(load_model("smollm2-135m-instruct", dtype=args.dtype).model)
    state = target.new_state()
    target.forward(state, 0, list(range(10, 300)))
    drafts, num, stop_ids = torch.randint(0, 49_152, (1, 7)), torch.tensor([7]), torch.tensor([2])
    after, again = [], []
    for _ in range(args.rounds):
        logits = target.forward(state, 290, list(range(40, 48))).unsqueeze(0)  # [1, 8, V]
        after.append(accept_rule(logits, drafts, num, stop_ids))
        again.append(accept_rule(logits, drafts, num, stop_ids))
        target.truncate(state, 290)
    rows = []
    for i, step in enumerate(STEPS):
        a, b = (1e6 * statistics.median(r[i] for r in runs) for runs in (after, again))
        rows.append({"call": step, "after_forward_us": round(a, 1), "again_us": round(b, 1)})
    total = [round(sum(r[k] for r in rows), 1) for k in ("after_forward_us", "again_us")]
    md = (f"# Small torch calls right after a target forward ({args.dtype}, median µs over {args.rounds} forwards)\n\n"
          + markdown_table(["call", "after the forward", "again at once"],
                           [[r["call"], r["after_forward_us"], r["again_us"]] for r in rows] + [["all", *total]])
          + "\n")
    print(md)
    if args.out is not None:
        write_results(args.out, "post_forward_ops", {"machine": machine_info(), "args": vars(args) | {
            "out": str(args.out)}, "rows": rows, "total_us": total}, md)


if __name__ == "__main__":
    main()
