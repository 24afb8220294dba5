"""What asking for log-probabilities costs: the same batch of requests generated with and without them.

    .venv/bin/python scripts/logprobs_cost.py --out results/logprobs-s27

For each concurrency C, the first C prompts of the bench mix (chat-templated) run to completion through one engine
(the shipped DSpark drafter under the async scheduler, or --policy), greedy, --max-new-tokens each, once without
logprobs, once with logprobs=0 (the chosen token only) and once with logprobs=20 (the most alternatives the API
allows), in shuffled rounds; the median wall time of each gives tokens/s and the ratio to no logprobs. Greedy
output is the same in all three (checked), so the three runs do the same work apart from the log-probabilities.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from dspark.bench.common import load_bench_prompts, machine_info, markdown_table, shuffled_medians, write_results
from dspark.bench.serving import ALL_SETS
from dspark.decoding import SamplingParams
from dspark.engine.llm import LLM


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--policy", default="auto")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    llm = LLM(policy=args.policy, max_running=64)
    texts = [text for _, text in load_bench_prompts(ALL_SETS, 4)]
    variants = {"none": None, "logprobs=0": 0, "logprobs=20": 20}
    rows, data = [], {"config": vars(args) | {"out": str(args.out)}, "machine": machine_info(), "cells": []}
    for c in [int(x) for x in args.concurrency.split(",")]:
        prompts, outputs = texts[:c], {}

        def job(name, lp=None):
            params = SamplingParams(temperature=0, max_new_tokens=args.max_new_tokens, ignore_eos=True, logprobs=lp)
            return lambda: outputs.__setitem__(name, [d.token_ids for d in llm.generate(prompts, params)])
        seconds = shuffled_medians({name: job(name, lp) for name, lp in variants.items()}, args.rounds)
        if len({str(v) for v in outputs.values()}) != 1:
            raise AssertionError("greedy output changed with logprobs")
        tokens = c * args.max_new_tokens
        for name in variants:
            cell = {"concurrency": c, "variant": name, "seconds": seconds[name], "tok_s": tokens / seconds[name],
                    "vs_none": seconds["none"] / seconds[name]}
            data["cells"].append(cell)
            rows.append([c, name, round(cell["tok_s"], 1), round(cell["vs_none"], 3)])
    md = (f"# Cost of log-probabilities ({args.policy} policy, greedy, {args.max_new_tokens} tokens per request, "
          f"median of {args.rounds} shuffled rounds)\n\n"
          + markdown_table(["C", "variant", "tok/s", "throughput vs no logprobs"], rows) + "\n")
    print(md)
    if args.out:
        write_results(args.out, "logprobs_cost", data, md)


if __name__ == "__main__":
    main()
