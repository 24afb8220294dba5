"""Engine steps timed one by one against the cached speed profile, and live confidences against acceptance.

    .venv/bin/python scripts/engine_step_times.py --concurrency 1 --seconds 90
    .venv/bin/python scripts/engine_step_times.py --concurrency 4 --seconds 90 --confidence
    .venv/bin/python scripts/engine_step_times.py --concurrency 1 --seconds 75 --async-decisions
    .venv/bin/python scripts/engine_step_times.py --concurrency 1 --seconds 75 --async-decisions async-online
    .venv/bin/python scripts/engine_step_times.py --concurrency 1 --seconds 75 --async-decisions async:early_stop=1 \
        --out results/serving-s19-early-stop/async-decisions-c1.txt
    .venv/bin/python scripts/engine_step_times.py --concurrency 32 --seconds 25 --profile none

Closed-loop clients on the `bench serve` prompt mix, one engine per fixed policy stepped in turn. For every
decode-only step (no prefill in it) it records B (tokens in the forward) and the step's wall, forward and
drafter seconds, and prints medians per (policy, B) beside what the profile predicts for that B and request
count — the check that found the profile's missing per-request price. `--confidence` runs fixed-7 instead and
compares the calibrated confidences of every fully verified round with what was accepted (over-confidence on
the live workload makes the scheduler over-draft). `--async-decisions` runs the async scheduler and counts its
steps by kind (drafter skipped, K > 0 from old confidences, probe / Algorithm 1) with the drafts each verified
and how many of those were accepted. `--profile POLICY` runs that policy's engine under cProfile (after 15 s of
warm-up) and prints the functions with the most time of their own and the engine's commit phase.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import io
import pstats
import random
import shlex
import sys
import time
from pathlib import Path

import numpy as np

from dspark.bench.closed_loop import ClosedLoop
from dspark.bench.serving import ServeBenchConfig, setup
from dspark.engine.profiling import load_or_profile, profile_key


def step_times(loops: dict, seconds: float, profile) -> None:
    rec = {n: collections.defaultdict(list) for n in loops}
    prefill = {n: np.zeros(3) for n in loops}  # steps with a prompt chunk in them: count, step s, drafter s
    undrafted = {n: ([], []) for n in loops}  # decode-only steps that drafted nothing: after a plain / drafting step
    drafted_last = dict.fromkeys(loops, False)
    t_end, order = time.time() + seconds, random.Random(0)
    while time.time() < t_end:  # shuffled each round, as `bench serve` does: a step after a drafting one is slower
        for name, loop in order.sample(list(loops.items()), len(loops)):
            s = loop.engine.stats
            before = (s.steps, s.step_seconds_total, s.forward_seconds_total, s.drafter_seconds_total)
            loop.tick()
            plan = loop.engine.last_plan
            if plan is not None and plan.prefilling and s.steps > before[0]:
                prefill[name] += (1, s.step_seconds_total - before[1], s.drafter_seconds_total - before[3])
            drafted, drafted_last[name] = drafted_last[name], plan is not None and plan.drafted_requests > 0
            if plan is None or plan.prefilling or not plan.decoding or s.steps == before[0]:
                continue
            if not plan.drafted_requests:
                undrafted[name][drafted].append(s.step_seconds_total - before[1])
            rec[name][len(plan.tokens)].append((s.step_seconds_total - before[1], s.forward_seconds_total - before[2],
                                                s.drafter_seconds_total - before[3], len(plan.decoding)))
    for name, by_b in rec.items():
        for b, rows in sorted(by_b.items()):
            if len(rows) < 5:
                continue
            a = np.median(np.array(rows), axis=0)
            r = int(a[3])
            print(f"{name:8s} B={b:3d} R={r:2d} n={len(rows):4d}  step {1e3 * a[0]:6.1f} ms  forward {1e3 * a[1]:6.1f} "
                  f"(profile {1e3 * float(profile.step_s(b, n_requests=r)):6.1f})  drafter {1e3 * a[2]:5.1f} "
                  f"(profile {1e3 * float(profile.draft_s(r)):5.1f})")
    for name, (after_plain, after_draft) in undrafted.items():  # where a mean sits above its median
        both = np.array(after_plain + after_draft)
        if both.size:
            print(f"{name}: {both.size} decode-only steps that drafted nothing: median {1e3 * np.median(both):.1f} ms, "
                  f"mean {1e3 * both.mean():.1f}, 90 % {1e3 * np.quantile(both, 0.9):.1f}; after a plain step "
                  f"n={len(after_plain)} mean {1e3 * np.mean(after_plain or [np.nan]):.1f}, after a drafting step "
                  f"n={len(after_draft)} mean {1e3 * np.mean(after_draft or [np.nan]):.1f}")
    for name, loop in loops.items():
        st = loop.engine.stats
        n, step_s, drafter_s = prefill[name]
        print(f"{name}: {st.generation_tokens / loop.clock:.1f} tok/s overall, "
              f"tau {1 + st.num_accepted_tokens / max(1, st.decode_requests_total):.3f}; {st.steps} steps in "
              f"{st.step_seconds_total:.1f} s, drafter {st.drafter_seconds_total:.2f} s; {int(n)} steps with "
              f"prefill: {step_s:.1f} s, drafter {drafter_s:.2f} s of it")


def confidence_check(loop: ClosedLoop, seconds: float) -> None:
    engine, conf, acc = loop.engine, [], []
    t_end = time.time() + seconds
    while time.time() < t_end:
        before = {r.request_id: len(r.accepted_hist) for r in engine.running}
        loop.tick()
        plan = engine.last_plan
        if plan is None or plan.confidences is None:
            continue
        for i, req in enumerate(plan.decoding):
            if len(req.accepted_hist) > before.get(req.request_id, 0) and int(plan.lengths[i]) == plan.drafts.shape[1]:
                conf.append(plan.confidences[i])
                acc.append(req.accepted_hist[-1])
    if not conf:
        print("no fully verified round finished in time; run longer (--seconds)")
        return
    c, a = np.array(conf), np.array(acc)
    surv = np.cumprod(c, axis=1)
    print(f"{len(a)} rounds: accepted drafts per round {a.mean():.3f}, predicted {surv.sum(1).mean():.3f}")
    for j in range(c.shape[1]):
        reached = a >= j
        if reached.sum():
            print(f"slot {j + 1}: reached {reached.sum():5d}  acceptance {np.mean(a[reached] > j):.3f}  "
                  f"mean confidence {c[reached, j].mean():.3f}")
    # what pricing multiplies: the survival to each depth (product of the slots' confidences) against the share
    # of rounds that accepted at least that many drafts, over all rounds (each verified every slot)
    print("depth: predicted survival (mean product)  accepted at least that deep")
    for j in range(c.shape[1]):
        print(f"  {j + 1}: {surv[:, j].mean():.4f}  {np.mean(a > j):.4f}")
    # reliability of the survival to depth 1 and 2 by quintile of its prediction (over-confidence at the top makes
    # the rows that look best the ones most over-priced)
    for j in (0, 1):
        edges = np.quantile(surv[:, j], [0.2, 0.4, 0.6, 0.8])
        bins = np.searchsorted(edges, surv[:, j])
        cells = [f"{surv[bins == b, j].mean():.3f}->{np.mean(a[bins == b] > j):.3f}" for b in range(5)]
        print(f"survival to depth {j + 1} by quintile, predicted->accepted: " + "  ".join(cells))


def async_decisions(loop: ClosedLoop, seconds: float) -> None:
    engine, policy = loop.engine, loop.engine.policy
    steps, verified, accepted = collections.Counter(), collections.Counter(), collections.Counter()
    depths = collections.defaultdict(collections.Counter)  # kind -> slots drafted -> steps
    timed = collections.defaultdict(list)  # kind -> (R, step s, drafter s) of its decode-only steps
    ratios = []  # at each probe: Θ_K / Θ_0 of the best K the last pool priced
    t_end = time.time() + seconds
    while time.time() < t_end:
        st = engine.stats
        before = (st.num_accepted_tokens, st.steps, st.step_seconds_total, st.drafter_seconds_total)
        loop.tick()
        plan = engine.last_plan
        if plan is None or not plan.decoding:
            continue
        k = policy.last_capacity
        kind = "probe / Algorithm 1" if k is None else "skipped" if k == 0 else f"K = {k}" if k < 4 else "K >= 4"
        steps[kind] += 1
        if k is None and policy.last_ratio is not None:  # a probe: what the pool before it priced
            ratios.append(policy.last_ratio)
        verified[kind] += int(plan.lengths.sum())
        depths[kind][plan.draft_depth] += 1
        accepted[kind] += st.num_accepted_tokens - before[0]
        if not plan.prefilling and st.steps > before[1]:
            timed[kind].append((len(plan.decoding), st.step_seconds_total - before[2],
                                st.drafter_seconds_total - before[3]))
    st = engine.stats
    for kind, n in steps.most_common():
        print(f"{kind:20s} {n:6d} steps ({100 * n / sum(steps.values()):5.1f} %), {verified[kind]:6d} drafts verified, "
              f"{accepted[kind]:5d} accepted ({100 * accepted[kind] / max(1, verified[kind]):.1f} %); slots drafted: "
              + ", ".join(f"{d} x{m}" for d, m in sorted(depths[kind].items())))
    print(f"{st.generation_tokens / loop.clock:.1f} tok/s; accepted {st.num_accepted_tokens} of {st.num_draft_tokens} "
          f"verified drafts ({100 * st.num_accepted_tokens / max(1, st.num_draft_tokens):.1f} %)")
    if ratios:
        q = np.quantile(ratios, [0.1, 0.5, 0.9])
        print(f"best K priced before a probe, over plain decoding: {len(ratios)} probes, 10 / 50 / 90 % "
              f"{q[0]:.3f} / {q[1]:.3f} / {q[2]:.3f}; below 0.85 {np.mean(np.array(ratios) < 0.85):.0%}")
    step_costs(timed, st.step_seconds_total)


def step_costs(timed: dict, total_s: float) -> None:
    """Decode-only steps by kind against a skipped (plain) step with as many requests: what each kind costs."""
    plain = collections.defaultdict(list)
    for r, step_s, _ in timed.get("skipped", []):
        plain[r].append(step_s)
    plain_s = {r: float(np.median(v)) for r, v in plain.items() if len(v) >= 5}
    print(f"decode-only steps (no prefill); extra = step - median skipped step at the same R, summed "
          f"(share of all {total_s:.1f} s of step time)")
    for kind, rows in sorted(timed.items()):
        a = np.array(rows)
        extra = [s - plain_s[int(r)] for r, s, _ in rows if int(r) in plain_s]
        print(f"{kind:20s} n={len(rows):5d}  step {1e3 * np.median(a[:, 1]):6.1f} ms  drafter "
              f"{1e3 * np.median(a[:, 2]):5.1f} ms  extra {1e3 * np.median(extra) if extra else float('nan'):6.1f} ms "
              f"median, {sum(extra):6.2f} s in all ({100 * sum(extra) / total_s:.2f} %)")


def profile_engine(loop: ClosedLoop, seconds: float) -> None:
    t_end = time.time() + 15
    while time.time() < t_end:
        loop.tick()
    prof = cProfile.Profile()
    prof.enable()
    t_end = time.time() + seconds
    while time.time() < t_end:
        loop.tick()
    prof.disable()
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(15)
    stats.sort_stats("cumulative").print_stats("_commit_decoding|verify_requests|plan_step|_feed_drafter|propose|prepare|_price|select|capacity|survivals|flush")
    stats.print_callees("_commit_decoding|verify_requests|_sampled_rows")  # where the time outside the model goes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=90.0)
    ap.add_argument("--drafter", default="dspark")
    ap.add_argument("--policies", default="none,mtp1,fixed-3,fixed-7", help="policies to time (comma-separated)")
    ap.add_argument("--confidence", action="store_true", help="fixed-7: confidences vs acceptance")
    ap.add_argument("--async-decisions", nargs="?", const="async", default=None, metavar="POLICY",
                    help="an async scheduler (default async): steps by kind of decision")
    ap.add_argument("--profile", default=None, metavar="POLICY", help="cProfile this policy's engine")
    ap.add_argument("--dtype", default="float32", help="the target's dtype (bench serve's --dtype)")
    ap.add_argument("--temperature", type=float, default=0.0, help="every request's temperature (bench serve's)")
    ap.add_argument("--top-p", type=float, default=1.0, help="every request's top-p (bench serve's)")
    ap.add_argument("--out", default=None, metavar="FILE",
                    help="also write the report to FILE, headed by the command line and the date")
    args = ap.parse_args()
    if args.out is None:
        run(args)
        return
    tee = _Tee(sys.stdout)
    with contextlib.redirect_stdout(tee):
        run(args)
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = f"# .venv/bin/python {' '.join(shlex.quote(a) for a in sys.argv)}   ({time.strftime('%Y-%m-%d %H:%M')})\n"
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(header + tee.getvalue())
    tmp.replace(path)  # atomic: an interrupted run leaves no half report


class _Tee(io.StringIO):
    """Prints as it goes and keeps a copy."""

    def __init__(self, stream):
        super().__init__()
        self.stream = stream

    def write(self, text: str) -> int:
        self.stream.write(text)
        return super().write(text)


def run(args) -> None:
    policies = (("fixed-7",) if args.confidence else (args.async_decisions,) if args.async_decisions
                else (args.profile,) if args.profile else tuple(args.policies.split(",")))
    cfg = ServeBenchConfig(drafter=args.drafter, dtype=args.dtype, policies=policies, concurrency=(args.concurrency,),
                           max_new_tokens=64, temperature=args.temperature, top_p=args.top_p)
    loaded, drafter, prompts, params, engines = setup(cfg)
    loops = {n: ClosedLoop(e, prompts, args.concurrency, params, 0.5) for n, e in engines.items()}
    if args.confidence:
        confidence_check(loops["fixed-7"], args.seconds)
        return
    if args.async_decisions:
        async_decisions(loops[args.async_decisions], args.seconds)
        return
    if args.profile:
        profile_engine(loops[args.profile], args.seconds)
        return
    profile = load_or_profile(loaded.model, profile_key(cfg.model, cfg.dtype, drafter.profile_id, loaded.model), drafter=drafter)
    step_times(loops, args.seconds, profile)


if __name__ == "__main__":
    main()
