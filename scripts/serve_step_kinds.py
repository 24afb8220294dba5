"""Where a closed loop's steps go: prefill / drafting / plain steps, for `none` and `async`, same prompts.

    .venv/bin/python scripts/serve_step_kinds.py --concurrency 4 --steps 400 --length-spread 0
    .venv/bin/python scripts/serve_step_kinds.py --concurrency 4 --steps 400 --length-spread 0.5

With one output length, plain decoding's clients finish together and share every prefill forward; a policy that
accepts a draft now and then drifts out of step and runs more, smaller prefill steps for the same requests.
"""
from __future__ import annotations

import argparse
import collections
import time

from dspark.bench.closed_loop import ClosedLoop
from dspark.bench.common import load_bench_prompts
from dspark.bench.serving import ALL_SETS
from dspark.decoding import SamplingParams
from dspark.drafters import make_drafter
from dspark.engine.engine import Engine, EngineConfig
from dspark.engine.llm import build_policy
from dspark.generate import prompt_ids
from dspark.models import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--drafter", default="dspark")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--length-spread", type=float, default=0.5)
    args = ap.parse_args()
    loaded = load_model(args.model, dtype="float32")
    drafter = make_drafter(args.drafter, target=loaded.model, gamma=7)
    prompts = [prompt_ids(loaded.tokenizer, t, chat=True) for _, t in load_bench_prompts(ALL_SETS, 8)]
    params = SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens, seed=0)
    for name in ("none", "async"):
        policy = build_policy(name, drafter, args.model, "float32", loaded.model, 7)
        engine = Engine(loaded.model, loaded.tokenizer, drafter if name != "none" else None, policy,
                        loaded.eos_ids, EngineConfig(gamma=7, max_running=args.concurrency))
        loop = ClosedLoop(engine, prompts, args.concurrency, params, args.length_spread)
        times: dict[str, list[float]] = collections.defaultdict(list)
        for _ in range(args.steps):
            t0 = time.perf_counter()
            loop.tick()
            plan = engine.last_plan
            kind = "prefill" if plan.prefilling else "drafting" if plan.propose_seconds else "plain"
            times[kind].append(time.perf_counter() - t0)
        s = engine.stats
        print(f"{name}: {len(loop.done)} requests finished, {s.prompt_tokens} prompt tokens, "
              f"{s.generation_tokens} generated, {s.num_accepted_tokens} drafts accepted")
        for kind, ts in sorted(times.items()):
            print(f"  {kind:8s} steps {len(ts):4d}  total {sum(ts):6.2f} s  median {1000 * sorted(ts)[len(ts) // 2]:6.1f} ms")


if __name__ == "__main__":
    main()
