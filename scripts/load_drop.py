"""How soon the async scheduler drafts again when the load falls: closed-loop clients at a high concurrency, then
at a low one, in cycles, for several async variants stepped in turn on one prompt mix.

    .venv/bin/python scripts/load_drop.py --high 16 --low 2 --cycles 4 --dtype bfloat16 --temperature 1 \
        --policies async,async:watch_load=0,async:max_probe_every=128,async:max_probe_every=128:watch_load=0

Under load the scheduler skips the drafter and probes now and then, backing off to one probe in
``max_probe_every`` skipped steps; at low load drafting pays again, but it only learns so from a probe. Each cycle
runs every policy's loop at ``--high`` clients for ``--high-seconds`` of its own clock, then lets it drain to
``--low`` clients (no new prompts until then) and serves ``--low`` clients for ``--low-seconds``. Printed per
policy, medians over cycles: the steps from reaching the low load to its first drafting step (a probe or K > 0),
the seconds that took, and the throughput of the low phase. Every loop sees the same prompts and length limits.
"""
from __future__ import annotations

import argparse
import json
import random

import numpy as np

from dspark.bench.closed_loop import ClosedLoop
from dspark.bench.serving import ServeBenchConfig, setup


class Phase:
    """One loop's progress through the current cycle."""

    def __init__(self, loop: ClosedLoop):
        self.loop, self.stage, self.t0, self.tokens0 = loop, "high", loop.clock, 0
        self.steps_low = self.drafted_low = 0  # steps at the low load, and those that drafted
        self.first_draft: tuple[int, float] | None = None  # (steps, seconds) at low load before drafting


def advance(ph: Phase, args) -> None:
    """One tick of ``ph.loop`` and the bookkeeping of its stage: high → drain → low → done."""
    loop = ph.loop
    if ph.stage == "high" and loop.clock - ph.t0 >= args.high_seconds:
        ph.stage = "drain"
    if ph.stage in ("drain", "low"):
        loop.limit = loop.sent  # finished requests are not replaced while more than --low run
    loop.tick()
    if ph.stage == "drain" and len(loop.live) <= args.low:
        ph.stage, ph.t0, ph.tokens0 = "low", loop.clock, loop.engine.stats.generation_tokens
    elif ph.stage == "low":
        ph.steps_low += 1
        if getattr(loop.engine.policy, "last_capacity", 0) != 0:  # a probe (None) or K > 0
            ph.drafted_low += 1
            if ph.first_draft is None:
                ph.first_draft = (ph.steps_low, loop.clock - ph.t0)
    if ph.stage == "low":
        loop.limit = None
        while len(loop.live) < args.low:  # top up: the low phase serves exactly --low clients
            loop.live.append(loop._submit())
        if loop.clock - ph.t0 >= args.low_seconds:
            ph.stage = "done"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--high", type=int, default=16)
    ap.add_argument("--low", type=int, default=2)
    ap.add_argument("--high-seconds", type=float, default=20.0)
    ap.add_argument("--low-seconds", type=float, default=10.0)
    ap.add_argument("--cycles", type=int, default=4)
    ap.add_argument("--policies", default="async,async:watch_load=0")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--out", default=None, help="write the per-cycle numbers here as JSON")
    args = ap.parse_args()
    if not 1 <= args.low < args.high:
        ap.error(f"need 1 <= --low < --high, got {args.low}, {args.high}")
    policies = tuple(args.policies.split(","))
    cfg = ServeBenchConfig(drafter="dspark", dtype=args.dtype, policies=policies, concurrency=(args.high,),
                           max_new_tokens=64, temperature=args.temperature)
    _, _, prompts, params, engines = setup(cfg)
    loops = {p: ClosedLoop(engines[p], prompts, args.high, params, 0.5) for p in policies}
    order, rows = random.Random(0), {p: [] for p in policies}
    for cycle in range(args.cycles):
        phases = {p: Phase(loop) for p, loop in loops.items()}
        for loop in loops.values():
            loop.limit = None
            while len(loop.live) < args.high:
                loop.live.append(loop._submit())
        while any(ph.stage != "done" for ph in phases.values()):
            for p in order.sample(policies, len(policies)):  # in turn, shuffled: the same machine modes for all
                if phases[p].stage != "done":
                    advance(phases[p], args)
        for p, ph in phases.items():
            tokens = ph.loop.engine.stats.generation_tokens - ph.tokens0
            steps, secs = ph.first_draft or (ph.steps_low, ph.loop.clock - ph.t0)
            rows[p].append({"steps_to_draft": steps, "seconds_to_draft": secs, "drafted": ph.first_draft is not None,
                            "drafting_share": ph.drafted_low / max(1, ph.steps_low),
                            "low_tok_s": tokens / (ph.loop.clock - ph.t0)})
        print(f"cycle {cycle + 1}/{args.cycles}: " + "; ".join(
            f"{p} {rows[p][-1]['steps_to_draft']} steps" for p in policies), flush=True)
    print(f"\n{args.high} → {args.low} clients, {args.cycles} cycles ({args.high_seconds:g} s high, "
          f"{args.low_seconds:g} s low), medians over cycles")
    print("| policy | steps to first draft | seconds to first draft | low-phase steps drafting | low-phase tok/s |\n"
          "|---|---|---|---|---|")
    for p in policies:
        med = {k: np.median([x[k] for x in rows[p]]) for k in rows[p][0] if k != "drafted"}
        print(f"| {p} | {med['steps_to_draft']:.0f} | {med['seconds_to_draft']:.2f} | {med['drafting_share']:.2f} "
              f"| {med['low_tok_s']:.1f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "cycles": rows}, f, indent=1)


if __name__ == "__main__":
    main()
