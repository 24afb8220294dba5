"""What prompt-prefix reuse does to the serving mix of `dspark bench serve` (distinct questions behind the chat
template's shared head; they recur once a cell sends more than the mix's 48), the same closed loops on two engines — prefix reuse on and
off — stepped in turn in one process, each on its own clock; per policy, concurrency and repeat.

    python scripts/prefix_overhead.py --policies none,async --concurrency 4,16 --repeats 3 --out results/prefix-overhead-s28
"""
from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from dspark.bench.closed_loop import ClosedLoop, run_loops
from dspark.bench.common import machine_info, markdown_table, median, write_results
from dspark.bench.serving import ServeBenchConfig, rotated, setup
from dspark.engine.engine import Engine
from dspark.engine.llm import build_policy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafter", default="dspark")
    ap.add_argument("--policies", default="none,async")
    ap.add_argument("--concurrency", default="4,16")
    ap.add_argument("--requests-per-client", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("results/prefix-overhead"))
    args = ap.parse_args()
    levels = tuple(int(c) for c in args.concurrency.split(","))
    cfg = ServeBenchConfig(drafter=args.drafter, policies=tuple(args.policies.split(",")), concurrency=levels,
                           max_new_tokens=args.max_new_tokens)
    loaded, drafter, prompts, params, engines = setup(cfg)
    rows, runs = [], []
    for policy, base in engines.items():
        for c in levels:
            ratios, hits = [], []
            for rep in range(args.repeats):
                pair = {on: Engine(base.model, base.tokenizer, base.drafter,  # a policy each: async keeps state
                                   build_policy(policy, drafter, cfg.model, cfg.dtype, loaded.model, cfg.gamma),
                                   base.eos_ids, dataclasses.replace(base.config, prefix_cache=on))
                        for on in (True, False)}
                loops = [ClosedLoop(pair[on], rotated(prompts, rep, args.repeats), c, params, cfg.length_spread,
                                    limit=c * args.requests_per_client) for on in (True, False)]
                on, off = run_loops(loops, None, seed=rep)
                ratios.append(on["throughput_tok_s"] / off["throughput_tok_s"])
                s = pair[True].stats
                hits.append(s.cached_prompt_tokens / (s.cached_prompt_tokens + s.prompt_tokens))
                runs.append({"policy": policy, "concurrency": c, "repeat": rep, "on": on, "off": off})
                print(policy, c, rep, f"on/off {ratios[-1]:.3f}, prompt tokens copied {hits[-1]:.1%}")
            rows.append([policy, c, median(ratios), f"{min(ratios):.3f}–{max(ratios):.3f}", f"{median(hits):.1%}"])
    headers = ["policy", "C", "throughput on/off (median)", "range", "prompt tokens copied"]
    write_results(args.out, "prefix_overhead", {"machine": machine_info(), "args": vars(args) | {"out": str(args.out)},
                                                "rows": rows, "runs": runs},
                  "# Prefix reuse on `dspark bench serve`'s mix: 48 distinct questions behind the chat template's shared head (their prompts recur once a cell sends more than 48 requests: C = 16 × 8)\n\n" + markdown_table(headers, rows) + "\n")


if __name__ == "__main__":
    main()
