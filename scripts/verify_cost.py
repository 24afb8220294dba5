"""What verifying a step of sampled requests costs where their rows lie, and through the padded buffers, in one process.

    .venv/bin/python scripts/verify_cost.py --out results/verify-cost-s49

`verify_requests` as the engine calls it: R requests, each verifying k drafts (k + 1 rows of a 49,152-token
vocabulary, the requests' rows in order in one logits tensor), every request at the same temperature; "ragged"
cases give the requests 0..k drafts in turn, as the async scheduler's top-K does. "table" is the path the engine
takes since session 49 (`batch._verify_table`: one to_probs call over the rows where they lie, `verify_rows`);
"padded" the one top-p and per-request logit adjustments still take (`_sampled_rows` + `verify`), forced here by
patching `batch._one_softmax`. Before session 49 requests of equal k took the padded path over a slice of the table
(no copy), ragged ones the copy. Both paths are timed in turn, medians over `--repeats` runs of `--calls` calls
each, and must pick the same tokens (they compute the same bits).
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from unittest import mock

import torch

from dspark.decoding import SamplingParams, batch
from dspark.decoding.batch import verify_requests

VOCAB, GAMMA = 49_152, 7


def baseline_patches() -> ExitStack:
    stack = ExitStack()
    stack.enter_context(mock.patch.object(batch, "_one_softmax", lambda *args: False))
    return stack


def case(R: int, k: int, top_p: float, ragged: bool, seed: int = 0):
    """The arguments of one engine call: R requests verifying k drafts each (ragged: 0..k in turn)."""
    g = torch.Generator().manual_seed(seed)
    counts = [(k - r % (k + 1)) if ragged else k for r in range(R)]
    starts = [sum(n + 1 for n in counts[:r]) for r in range(R)]
    table = torch.randn(starts[-1] + counts[-1] + 1, VOCAB, generator=g) * 3  # [Σ rows, V]
    logits = [table[s: s + n + 1] for s, n in zip(starts, counts)]
    drafts = torch.randint(0, VOCAB, (R, GAMMA), generator=g)
    q = torch.softmax(torch.randn(R, GAMMA, VOCAB, generator=g) * 3, -1) if k else None
    params = [SamplingParams(temperature=1.0, top_p=top_p)] * R
    return logits, drafts, torch.tensor(counts), q, params, table, starts


def run(args_, seed: int):
    logits, drafts, num, q, params, table, starts = args_
    gens = [torch.Generator().manual_seed(seed + r) for r in range(len(logits))]
    return verify_requests(logits, drafts, num, q, params, gens, torch.zeros(drafts.shape, dtype=torch.bool),
                           table=(table, starts), histories=[[1]] * len(logits), stop_ids=[{2}] * len(logits),
                           prompts=[[5]] * len(logits))


def timed(args_, calls: int, repeats: int) -> float:
    """Median ms per call."""
    for _ in range(3):
        run(args_, 0)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for i in range(calls):
            run(args_, i)
        times.append((time.perf_counter() - t0) / calls * 1e3)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", default="1,4,16,32")
    ap.add_argument("--drafts", default="0,3")
    ap.add_argument("--top-p", default="1,0.95")
    ap.add_argument("--ragged", default="0,1", help="0: every request verifies k drafts; 1: 0..k in turn")
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=None, help="a folder for verify_cost.json and verify_cost.md")
    args = ap.parse_args()
    rows = []
    for top_p in map(float, args.top_p.split(",")):
        for R in map(int, args.requests.split(",")):
            for k, ragged in ((k, bool(int(x))) for k in map(int, args.drafts.split(","))
                              for x in args.ragged.split(",")):
                if ragged and (k == 0 or R == 1):
                    continue
                a = case(R, k, top_p, ragged)
                fast = run(a, 7)
                with baseline_patches():
                    slow = run(a, 7)
                    before = timed(a, args.calls, args.repeats)
                after = timed(a, args.calls, args.repeats)
                same = all(torch.equal(getattr(fast, f), getattr(slow, f))
                           for f in ("accepted", "next_token", "stopped"))
                rows.append({"top_p": top_p, "requests": R, "drafts": f"0..{k}" if ragged else k,
                             "padded_ms": round(before, 3), "table_ms": round(after, 3),
                             "ratio": round(after / before, 3), "same_tokens": same})
                print(rows[-1], flush=True)
                if not same:
                    raise SystemExit("the two paths picked different tokens")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        meta = {"machine": platform.processor() or platform.machine(), "torch": torch.__version__,
                "threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "calls": args.calls, "repeats": args.repeats}
        (out / "verify_cost.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        lines = ["# verify_requests per call, T = 1 (median ms; padded: forced, in the same process)", "",
                 "    .venv/bin/python scripts/" + " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "",
                 f"torch {meta['torch']}, {meta['threads']} threads, {meta['date']}; top-p < 1 takes the padded path "
                 "in both columns", "",
                 "| top-p | requests | drafts each | padded | table | table / padded | same tokens |",
                 "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['top_p']} | {r['requests']} | {r['drafts']} | {r['padded_ms']} | {r['table_ms']} | "
                  f"{r['ratio']} | {r['same_tokens']} |" for r in rows]
        (out / "verify_cost.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
