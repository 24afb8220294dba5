"""What a scheduling policy costs per engine step, timed in place (after the model's forwards, as served).

    .venv/bin/python scripts/policy_step_cost.py --policy async --seconds 25
    PYTHONPATH=<other checkout>/src .venv/bin/python scripts/policy_step_cost.py --policy async   # another version

One closed loop of `bench serve` prompts at the given concurrency; every call of the policy's prepare / select is
timed and binned by kind (prepare: K reused from its memo or priced again; select: drafter skipped, top-K, or
Algorithm 1 for probes and the first steps; with live prices, also the engine's reports). With `--cold` it also times one small numpy job — a step's survivals —
three times in a row right before each select of a drafting step (which warms the caches for that select, so the
policy's own times are then not what it costs): the first run pays for the caches the model's forwards have just
flushed, which is why the policy's work costs several times more in the engine than in a loop of its own.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import numpy as np

from dspark.bench.closed_loop import ClosedLoop
from dspark.bench.serving import ServeBenchConfig, setup
from dspark.scheduling.policies import as_confidences, step_survivals


def instrument(policy, spent: dict[str, list[float]], cold: list[list[float]]) -> None:
    select, prepare = policy.select, policy.prepare

    def timed_select(c=None, **kwargs):
        capacity = getattr(policy, "last_capacity", "fixed")
        kind = {None: "algorithm 1", 0: "skipped", "fixed": "fixed"}.get(capacity, "top-K")
        if c is not None:
            for runs in cold:
                t0 = time.perf_counter()
                step_survivals(as_confidences(c))
                runs.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        out = select(c, **kwargs)
        spent[f"select, {kind}"].append(time.perf_counter() - t0)
        return out

    def timed_prepare(n_requests, **kwargs):
        memo = getattr(policy, "_memo", (None,))[0]
        t0 = time.perf_counter()
        out = prepare(n_requests, **kwargs)
        again = getattr(policy, "_memo", (None,))[0] != memo
        spent[f"prepare, {'priced' if again else 'reused'}"].append(time.perf_counter() - t0)
        return out

    policy.select, policy.prepare = timed_select, timed_prepare
    observe = getattr(policy, "observe_step", None)
    if getattr(policy, "live", None) is not None:  # live prices: the engine's reports cost something too

        def timed_observe(*args):
            t0 = time.perf_counter()
            observe(*args)
            spent["observe_step"].append(time.perf_counter() - t0)

        policy.observe_step = timed_observe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", default="async")
    ap.add_argument("--drafter", default="dspark")
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=25.0)
    ap.add_argument("--dtype", default="float32", help="the target's dtype (bench serve's --dtype)")
    ap.add_argument("--temperature", type=float, default=0.0, help="every request's temperature")
    ap.add_argument("--cold", action="store_true", help="time a numpy job cold and warm (see above)")
    ap.add_argument("--out", default=None, metavar="FILE", help="also write the report here")
    args = ap.parse_args()
    cfg = ServeBenchConfig(drafter=args.drafter, dtype=args.dtype, policies=(args.policy,),
                           concurrency=(args.concurrency,), max_new_tokens=64, temperature=args.temperature)
    _, _, prompts, params, engines = setup(cfg)
    engine = engines[args.policy]
    spent: dict[str, list[float]] = defaultdict(list)
    cold: list[list[float]] = [[], [], []] if args.cold else []
    instrument(engine.policy, spent, cold)
    loop = ClosedLoop(engine, prompts, args.concurrency, params, 0.5)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < args.seconds:
        loop.tick()
    steps, seconds = engine.stats.steps, time.perf_counter() - t0
    lines = [f"policy {args.policy}, C = {args.concurrency}: {steps} steps, {1e3 * seconds / steps:.2f} ms a step",
             f"{'call':28s} {'calls':>6s} {'median us':>10s} {'us per step':>12s}"]
    for kind, times in sorted(spent.items()):
        lines.append(f"{kind:28s} {len(times):6d} {1e6 * statistics.median(times):10.1f} "
                     f"{1e6 * sum(times) / steps:12.1f}")
    total = sum(map(sum, spent.values()))
    lines.append(f"{'all policy calls':28s} {'':6s} {'':10s} {1e6 * total / steps:12.1f} "
                 f"({100 * total / seconds:.2f} % of the time)")
    if cold and cold[0]:
        c = np.random.default_rng(0).random((args.concurrency, 7))
        warm = []
        for _ in range(1000):
            t = time.perf_counter()
            step_survivals(as_confidences(c))
            warm.append(time.perf_counter() - t)
        lines.append("one step's survivals after a drafting step, 1st / 2nd / 3rd run in a row, and in a loop of "
                     "its own (median us): " + " / ".join(f"{1e6 * statistics.median(r):.1f}" for r in cold)
                     + f", {1e6 * statistics.median(warm):.1f}")
    report = "\n".join(lines)
    print(report)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(report + "\n")


if __name__ == "__main__":
    main()
