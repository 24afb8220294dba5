"""Where a batch-1 speculative round's time goes, piece by piece: the Generation loop (every draft verified, as
`dspark bench acceptance` times it) with the drafter's and the verifier's parts wrapped in timers.

    .venv/bin/python scripts/batch1_round_phases.py --temperature 0 --out results/round-phases-s46/new-t0

To compare two trees, run it once with each on PYTHONPATH (`PYTHONPATH=/tmp/old/src ...`). The prompts are the
first `--per-set` of each `--sets` benchmark set (../shared/bench_data); two warm-up generations come first.
A piece's "ms / round" sums its calls per round; pieces nest (propose holds draft_states ... calibrate).
"""
from __future__ import annotations

import argparse
import collections
import functools
import os
import sys
import time
from pathlib import Path

import torch

from dspark.bench.common import load_bench_prompts, machine_info, markdown_table, write_results
from dspark.decoding.sampling import SamplingParams
from dspark.drafters import dspark as dspark_module
from dspark.drafters import make_drafter
from dspark.engine import speculative
from dspark.engine.speculative import Generation, TransformerTarget
from dspark.generate import prompt_ids
from dspark.models import load_model


def timed(times: dict, name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        times[name].append(time.perf_counter() - t0)
        return out
    return wrapper


def instrument(drafter, target, times: dict) -> None:
    """Wrap the pieces of a round in timers (instance attributes and the modules' names the loop calls)."""
    model = drafter.model
    for obj, name, label in ((drafter, "propose", "propose"), (model, "draft_states", "  backbone"),
                             (drafter, "draft_logits", "  LM head"), (drafter, "sample_block", "  sample block"),
                             (model.head, "step", "    Markov steps"), (model, "confidence_logits", "    confidence"),
                             (model, "to_full", "    to_full"), (model, "scatter_probs", "    scatter probs"),
                             (drafter, "_calibrate", "  calibrate"), (target, "forward", "target forward"),
                             (drafter, "observe", "observe")):
        setattr(obj, name, timed(times, label, getattr(obj, name)))
    dspark_module.draw = timed(times, "    draws", dspark_module.draw)
    for name in ("verify_greedy", "verify", "target_logits", "to_probs"):
        setattr(speculative, name, timed(times, f"verifier: {name}", getattr(speculative, name)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--drafter", default="dspark")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--sets", default="gsm8k,humaneval,mt-bench")
    ap.add_argument("--per-set", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    loaded = load_model(args.model, dtype=args.dtype)
    drafter = make_drafter(args.drafter, target=loaded.model, gamma=7)
    target = TransformerTarget(loaded.model, hidden_layers=tuple(drafter.needs_layers))
    texts = load_bench_prompts(tuple(args.sets.split(",")), args.per_set)
    prompts = [prompt_ids(loaded.tokenizer, text, True) for _, text in texts]
    times: dict = collections.defaultdict(list)
    instrument(drafter, target, times)

    def generate(i: int):
        params = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens, seed=i)
        gen = Generation(target, drafter, prompts[i % len(prompts)], params, loaded.eos_ids)
        for _ in gen:
            pass
        return gen.stats

    for i in range(2):
        generate(i)
    times.clear()
    rounds = tokens = 0
    decode_s = 0.0
    for i in range(len(prompts)):
        stats = generate(i)
        rounds, tokens = rounds + stats.rounds, tokens + stats.new_tokens - 1
        decode_s += stats.total_s - stats.ttft_s
    rows = [{"piece": k, "calls_per_round": len(v) / rounds, "ms_per_round": 1e3 * sum(v) / rounds,
             "median_ms": 1e3 * sorted(v)[len(v) // 2]} for k, v in times.items()]
    summary = {"rounds": rounds, "round_ms": 1e3 * decode_s / rounds, "tokens_per_round": tokens / rounds}
    table = markdown_table(["piece", "calls / round", "ms / round", "median ms a call"],
                           [[r["piece"], f"{r['calls_per_round']:.2f}", f"{r['ms_per_round']:.3f}",
                             f"{r['median_ms']:.3f}"] for r in rows])
    command = "PYTHONPATH=... " if "PYTHONPATH" in os.environ else ""
    command += "python " + " ".join(sys.argv)
    title = (f"{command}\n\n# A batch-1 round by piece ({args.model} {args.dtype}, drafter {args.drafter}, T = {args.temperature}, "
             f"{len(prompts)} prompts)\n\n{rounds} rounds, {summary['round_ms']:.2f} ms a round, "
             f"{summary['tokens_per_round']:.2f} tokens a round\n\n")
    print(title + table)
    if args.out is not None:
        write_results(args.out, "round_phases", {"machine": machine_info(), "config": {
            k: str(v) for k, v in vars(args).items()}, "summary": summary, "pieces": rows}, title + table)


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
