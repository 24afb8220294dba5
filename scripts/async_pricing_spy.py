"""How the async scheduler's decisions relate to what it priced: a spy on its K pricing in a closed loop.

    .venv/bin/python scripts/async_pricing_spy.py --concurrency 2 --seconds 60
    .venv/bin/python scripts/async_pricing_spy.py --concurrency 1 --seconds 50 --policy async:reprobe_every=1

Runs one engine with the given async policy on the `bench serve` prompt mix and prints: steps by kind (drafted with
K > 0, skipped, probe), tok/s, and over the distinct confidence pools it priced (K is re-priced only when its pool
changes) the share that priced some K > 0 above plain decoding by the policy's margin, quantiles of the predicted
gain Θ_K / Θ_0, and how many steps / rows the pools held. A large gap between "pools priced K > 0" and "steps
drafted" means K = 0 decisions hold longer than the pricing warrants (what session 13 found at C = 2).
"""
from __future__ import annotations

import argparse
import collections
import time

import numpy as np

from dspark.bench.closed_loop import ClosedLoop
from dspark.bench.serving import ServeBenchConfig, setup
from dspark.scheduling import async_policy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--policy", default="async", help="an async policy spec, options allowed")
    ap.add_argument("--dtype", default="float32", help="the target's dtype (bench serve's --dtype)")
    ap.add_argument("--temperature", type=float, default=0.0, help="every request's temperature")
    args = ap.parse_args()
    priced = []  # (requests, pooled steps, pooled rows, best K, predicted gain)
    alone, joint = async_policy.capacity_from_survivals, async_policy.capacity_and_depth

    def spy(survivals, shapes, sps, n_requests):  # K alone (R > joint_requests)
        best, ratio = alone(survivals, shapes, sps, n_requests)
        priced.append((n_requests, len(shapes), sum(rows for rows, _ in shapes), best, ratio))
        return best, ratio

    def spy_joint(by_depth, rows, sps, n_requests):  # K and the depth together (R <= joint_requests)
        best, depth, ratio = joint(by_depth, rows, sps, n_requests)
        priced.append((n_requests, len(rows), sum(rows), best, ratio))
        return best, depth, ratio

    async_policy.capacity_from_survivals, async_policy.capacity_and_depth = spy, spy_joint
    cfg = ServeBenchConfig(drafter="dspark", dtype=args.dtype, policies=(args.policy,),
                           concurrency=(args.concurrency,), max_new_tokens=64, temperature=args.temperature)
    _, _, prompts, params, engines = setup(cfg)
    engine = engines[args.policy]
    loop, kinds = ClosedLoop(engine, prompts, args.concurrency, params, 0.5), collections.Counter()
    capacities = collections.Counter()  # K of each step (None: Algorithm 1)
    t_end = time.time() + args.seconds
    while time.time() < t_end:
        loop.tick()
        k = engine.policy.last_capacity
        capacities[k] += 1
        kinds["probe / Algorithm 1" if k is None else "skipped" if k == 0 else "drafted, K > 0"] += 1
    total = sum(kinds.values())
    print(", ".join(f"{kind} {n} ({100 * n / total:.1f} %)" for kind, n in kinds.most_common()),
          f"| {engine.stats.generation_tokens / loop.clock:.1f} tok/s")
    print("steps by K:", ", ".join(f"{'Alg. 1' if k is None else k}: {n}" for k, n in
                                   sorted(capacities.items(), key=lambda kv: -1 if kv[0] is None else kv[0])))
    rows = [p for p in priced if p[0] == args.concurrency]
    if not rows:
        print("no pool was priced at this concurrency; run longer")
        return
    gain = np.array([p[4] for p in rows])
    print(f"{len(rows)} distinct pools priced; {100 * np.mean(gain > 1 + engine.policy.min_gain):.0f} % priced K > 0 "
          f"past the {engine.policy.min_gain:.0%} margin; predicted gain quantiles 10/25/50/75/90 %: "
          f"{np.round(np.quantile(gain, [.1, .25, .5, .75, .9]), 3).tolist()}")
    print("pooled steps:", collections.Counter(p[1] for p in rows).most_common(5),
          "| pooled rows:", collections.Counter(p[2] for p in rows).most_common(5))


if __name__ == "__main__":
    main()
