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
from dspark.bench.serving import ServeBenchConfig, setup


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--drafter", default="dspark")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--length-spread", type=float, default=0.5)
    args = ap.parse_args()
    cfg = ServeBenchConfig(model=args.model, drafter=args.drafter, policies=("none", "async"),
                           concurrency=(args.concurrency,), max_new_tokens=args.max_new_tokens,
                           length_spread=args.length_spread)
    _, _, prompts, params, engines = setup(cfg)
    for name, engine in engines.items():
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
