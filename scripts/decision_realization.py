"""What the async scheduler's K decisions promised against what the steps they made accepted.

    .venv/bin/python scripts/decision_realization.py --concurrency 1 --seconds 120 --dtype bfloat16 --temperature 1

Runs one engine with an async policy on the `bench serve` prompt mix. On every step whose K came from old
confidences (K > 0, not a probe) and whose pooled steps all held as many rows as the step has requests, it records
three numbers: the drafts the pool predicted this step would accept (the mean over the pooled steps of their
top-K survivals at the drafted depth: what the price of K assumed), the drafts the step's own confidences predicted
for the lengths it verified, and the drafts it accepted. Printed: their means and ratios, over all such steps and
by quartile of the pool's prediction. A pool that promises more than its steps accept while the steps' own
confidences do not is the winner's curse of choosing K on a noisy estimate: the steps drafted are the ones whose
pool happened to look good. Probes (Algorithm 1 on the current confidences) are reported beside them.
"""
from __future__ import annotations

import collections
import time

import numpy as np

from _one_engine import engine_args, one_engine
from dspark.scheduling.depth_pricing import depth_survivals


def pool_prediction(policy, n_requests: int, gamma: int) -> float | None:
    """Drafts the pool predicts a step verifying K (at the drafted depth) accepts; None if it pools other R."""
    _, pool = policy._old_confidences()
    k, depth = policy.last_capacity, policy.draft_depth(gamma)
    sums = []
    for c, _, _ in pool:
        if c.shape[0] != n_requests:
            return None
        if c.shape[1] < depth:
            continue
        by_depth = depth_survivals(c)
        if getattr(policy, "_long", None) is not None:  # shrink < 1: what the policy priced is the shrunk pool
            by_depth = policy._long.shrunk(by_depth, policy.shrink)
        s = by_depth[depth - 1]  # [R·depth] descending survivals truncated to the depth
        sums.append(float(s[:k].sum()))
    return float(np.mean(sums)) if sums else None


def current_prediction(c: np.ndarray, lengths: np.ndarray) -> float:
    """Drafts the step's own confidences predict for the lengths it verified: Σ_r Σ_{j<ℓ_r} Π_{i<=j} c[r, i]."""
    surv = np.cumprod(c, axis=1)
    return float(sum(surv[r, :int(n)].sum() for r, n in enumerate(lengths)))


def report(name: str, rows: list) -> None:
    if not rows:
        print(f"{name}: none")
        return
    a = np.array(rows)  # [n, 3] pool prediction (nan for probes), own prediction, accepted
    print(f"{name}: {len(a)} steps; per step: pool predicted {np.nanmean(a[:, 0]):.3f}, own confidences "
          f"predicted {a[:, 1].mean():.3f}, accepted {a[:, 2].mean():.3f} (accepted / pool "
          f"{a[:, 2].mean() / np.nanmean(a[:, 0]):.3f}, / own {a[:, 2].mean() / a[:, 1].mean():.3f})")
    if np.isnan(a[:, 0]).all():
        return
    edges = np.quantile(a[:, 0], [0.25, 0.5, 0.75])
    q = np.searchsorted(edges, a[:, 0], side="right")
    for i in range(4):
        b = a[q == i]
        if len(b):
            print(f"  pool quartile {i + 1}: n={len(b):5d} pool {b[:, 0].mean():.3f}  own {b[:, 1].mean():.3f}  "
                  f"accepted {b[:, 2].mean():.3f}")


def main() -> None:
    args = engine_args(__doc__, concurrency=1, seconds=120.0).parse_args()
    engine, loop = one_engine(args)
    policy = engine.policy
    prepare, promised = policy.prepare, {}

    def spy(n_requests, context=None):
        drafts = prepare(n_requests, context)
        promised["pool"] = pool_prediction(policy, n_requests, engine.config.gamma) if policy.last_capacity else None
        return drafts

    policy.prepare = spy
    by_kind = collections.defaultdict(list)
    t_end = time.time() + args.seconds
    while time.time() < t_end:
        before = engine.stats.num_accepted_tokens
        promised["pool"] = None
        loop.tick()
        plan = engine.last_plan
        if plan is None or not plan.decoding or plan.confidences is None:
            continue
        k = policy.last_capacity
        kind = "probe" if k is None else f"K = {k}" if k < 4 else "K >= 4"
        if k is not None and promised["pool"] is None:
            continue  # its pool held steps of another R
        row = (np.nan if k is None else promised["pool"], current_prediction(plan.confidences, plan.lengths),
               engine.stats.num_accepted_tokens - before)
        by_kind[kind].append(row)
        if k is not None:
            by_kind["all K > 0"].append(row)
    promises = getattr(policy, "promises", None)
    print(f"{engine.stats.generation_tokens / loop.clock:.1f} tok/s" + ("" if promises is None else
          f"; accepted / promised drafts (check_promises) at the end: {promises.ratio:.3f}"))
    for kind in sorted(by_kind):
        report(kind, by_kind[kind])


if __name__ == "__main__":
    main()
