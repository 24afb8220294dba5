"""Policy variants on the serving simulator, with this machine's profile and the benchmark's own workload.

    .venv/bin/python scripts/simulate_variants.py --out results/sim-variants-s25
    .venv/bin/python scripts/simulate_variants.py --variants async,async:confirm=1 --concurrency 4 --seeds 3
    .venv/bin/python scripts/simulate_variants.py --concurrency 1,2 --keep 0.85 \
        --traces results/calibration-s34/traces.npz
    .venv/bin/python scripts/simulate_variants.py --dtype bfloat16 --concurrency 1,2,4 --walk \
        --traces results/calibration-s34/traces.npz

`--keep S` replays traffic on which the calibrated confidences are over-confident: each accepted draft of a
recorded round stays accepted with probability S (slot j's with S^j, since acceptance is left to right), the
confidences unchanged. On the `bench serve` mix at T = 1 the live acceptance ran 17 % under the confidences fitted
on held-out prompts (results/c1-s35/confidence.txt: 0.452 accepted drafts a round against 0.530 predicted);
S = 0.85 takes results/calibration-s34/traces.npz from 0.539 to about 0.45.

Before spending a 20-minute serving run on an async option, ask the simulator: each variant runs the cell
`dspark bench serve --requests-per-client N --max-new-tokens 64` would run (cold start, C × N requests, the drain;
the benchmark's prompt lengths, rotated per seed as its repeats rotate them; output lengths spread ±50 %) with the
same seeds, and is reported as its throughput over plain decoding's, median over the seeds. Since session 25 the
simulator prices a new request's prompt by the profile's prefill table and matches the measured cells within
0.93–1.02 (results/serving-s25-sim); it prices model time only, and a probe's drafting as the profile's drafting
table (not the backlog its requests feed first), so what it says about differences under ~0.5 % is a hint.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from dspark.bench.common import machine_info, write_results
from dspark.bench.serving import ServeBenchConfig, build_policy, rotated, setup
from dspark.engine.profiling import load_or_profile, profile_key
from dspark.scheduling.simulator import simulate
from dspark.scheduling.traces import AcceptanceTraces
from dspark.scheduling.workload import ClosedLoop

VARIANTS = ("none,mtp1,async,async:confirm=1,async:steady_run=4,async:far_probe_every=256,async:min_gain=0.06,"
            "async:probe_requests=1,async:max_probe_every=128")


def thinned(traces: AcceptanceTraces, keep: float, seed: int = 0) -> AcceptanceTraces:
    """The rounds with each accepted draft kept with probability `keep`: n_acc cut at the first one dropped."""
    if keep >= 1.0:
        return traces
    drops = np.random.default_rng(seed).random(traces.conf.shape) >= keep  # [M, γ] this slot's accept is lost
    slots = np.arange(traces.conf.shape[1])[None, :]
    first = np.where(drops & (slots < traces.n_acc[:, None]), slots, traces.conf.shape[1]).min(1)  # [M]
    return AcceptanceTraces(traces.conf, np.minimum(traces.n_acc, first))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafter", default="dspark")
    ap.add_argument("--dtype", default="float32", help="the target's dtype (its own profile)")
    ap.add_argument("--variants", default=VARIANTS, help="policies, comma-separated (none is always run)")
    ap.add_argument("--concurrency", default="1,2,4,8,16,32")
    ap.add_argument("--requests-per-client", type=int, default=16)
    ap.add_argument("--seeds", type=int, default=6)
    ap.add_argument("--traces", default="results/calibration-more/traces.npz")
    ap.add_argument("--keep", type=float, default=1.0,
                    help="each accepted draft stays accepted with this probability (over-confident traffic)")
    ap.add_argument("--walk", action="store_true",
                    help="each request replays consecutive recorded rounds (see simulate), not a random one a step")
    ap.add_argument("--out", default=None, help="directory for variants.json and variants.md")
    args = ap.parse_args()
    if not 0.0 < args.keep <= 1.0:
        ap.error(f"--keep must lie in (0, 1], got {args.keep}")
    cfg = ServeBenchConfig(drafter=args.drafter, policies=("none",), concurrency=(1,), dtype=args.dtype)
    loaded, drafter, prompts, _, _ = setup(cfg)
    profile = load_or_profile(loaded.model, profile_key(cfg.model, cfg.dtype, drafter.profile_id, loaded.model),
                              drafter=drafter, prefill=True)
    traces = thinned(AcceptanceTraces.load(args.traces), args.keep)
    mix = tuple(map(len, prompts))
    variants = ["none"] + [v for v in args.variants.split(",") if v and v != "none"]
    rows = []
    for c in (int(x) for x in args.concurrency.split(",")):
        tps = {}
        for v in variants:
            tps[v] = np.array([simulate(profile, traces, build_policy(v, drafter, cfg.model, cfg.dtype, loaded.model,
                                                                      traces.gamma),
                                        ClosedLoop(c, 64, prompt_mix=rotated(mix, seed % 3, 3), output_spread=0.5,
                                                   requests_per_client=args.requests_per_client),
                                        seed=seed, walk=args.walk).throughput_tps for seed in range(args.seeds)])
        rows.append({"concurrency": c, "none_tok_s": round(float(np.median(tps["none"])), 1),
                     **{v: round(float(np.median(tps[v] / tps["none"])), 4) for v in variants[1:]}})
    table = ("| C | none tok/s | " + " | ".join(variants[1:]) + " |\n|---|---|" + "---|" * (len(variants) - 1) + "\n"
             + "".join(f"| {r['concurrency']} | {r['none_tok_s']:.0f} | " + " | ".join(f"{r[v]:.4f}"
                                                                                for v in variants[1:]) + " |\n"
                       for r in rows))
    meta = {"profile": profile.key.as_dict() if profile.key else profile.source, "traces": args.traces,
            "keep": args.keep, "walk": args.walk, "mean_accepted": round(float(traces.n_acc.mean()), 4),
            "seeds": args.seeds, "requests_per_client": args.requests_per_client, **machine_info()}
    print(f"simulated throughput over plain decoding, median over {args.seeds} seeds\n\n{table}")
    if args.out:
        write_results(Path(args.out), "variants", {"settings": meta, "results": rows},
                      f"# Simulated policy variants ({time.strftime('%Y-%m-%d %H:%M')})\n\n{json.dumps(meta)}\n\n"
                      f"throughput over plain decoding, median over {args.seeds} seeds\n\n{table}")


if __name__ == "__main__":
    main()
