"""Where a probe's time goes under load: the async scheduler's steps timed by phase, probes against skipped steps.

    .venv/bin/python scripts/probe_step_cost.py --concurrency 16 --seconds 90 --dtype bfloat16 --temperature 1
    PYTHONPATH=/path/to/old/src .venv/bin/python scripts/probe_step_cost.py ...   # the same for an older tree

Runs one engine with the async policy on the `bench serve` prompt mix and times every decode-only step (no prompt
chunk in it) by phase: planning (feeding the drafted requests their deferred target states, drafting, choosing
lengths), the target forward, and committing (verification, emitting). Steps are grouped by kind: skipped (plain
decoding), probe (some requests drafted, verified by Algorithm 1) and K > 0. Printed: medians per kind and a
probe's extra time over a skipped step, in ms and in skipped steps, with the share of all step time probes took.
Above a few requests the scheduler mostly skips the drafter and probes now and then, so this is what it pays
beyond plain decoding there.
"""
from __future__ import annotations

import collections
import time

import numpy as np

from _one_engine import engine_args, one_engine
from dspark.engine import engine as engine_module

PHASES = ("plan", "forward", "commit")


def timed(phases: dict, name: str, fn):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            phases[name] += time.perf_counter() - t0
    return wrapper


def main() -> None:
    args = engine_args(__doc__, concurrency=16, seconds=90.0).parse_args()
    engine, loop = one_engine(args)
    phases = collections.defaultdict(float)
    engine_module.plan_step = timed(phases, "plan", engine_module.plan_step)
    engine.model.forward = timed(phases, "forward", engine.model.forward)
    engine._commit_decoding = timed(phases, "commit", engine._commit_decoding)
    rows = collections.defaultdict(list)
    total, t_end = 0.0, time.time() + args.seconds
    while time.time() < t_end:
        phases.clear()
        st = engine.stats
        steps, seconds = st.steps, st.step_seconds_total
        loop.tick()
        total += st.step_seconds_total - seconds
        plan = engine.last_plan
        if plan is None or st.steps == steps or plan.prefilling or not plan.decoding:
            continue
        k = engine.policy.last_capacity
        kind = "probe" if k is None else "skipped" if k == 0 else "K > 0"
        rows[kind].append([st.step_seconds_total - seconds, *(phases[p] for p in PHASES)])
    print(f"{engine.stats.generation_tokens / loop.clock:.1f} tok/s; {sum(len(r) for r in rows.values())} decode-only "
          f"steps, {total:.1f} s of step time in all")
    med = {kind: 1e3 * np.median(np.array(r), axis=0) for kind, r in rows.items()}
    for kind, m in sorted(med.items()):
        print(f"{kind:8s} n={len(rows[kind]):5d}  step {m[0]:6.1f} ms  " +
              "  ".join(f"{p} {v:5.1f}" for p, v in zip(PHASES, m[1:])))
    if "probe" in med and "skipped" in med:
        extra = med["probe"] - med["skipped"]
        share = sum(r[0] for r in rows["probe"]) / total
        print(f"a probe over a skipped step: {extra[0]:.1f} ms ({extra[0] / med['skipped'][0]:.2f} skipped steps): " +
              "  ".join(f"{p} {v:+.1f}" for p, v in zip(PHASES, extra[1:])) +
              f"; probes {len(rows['probe'])} steps, {100 * share:.1f} % of all step time")


if __name__ == "__main__":
    main()
