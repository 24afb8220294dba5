"""How steady the engine-work calibration is: the calibration run repeated, priced both ways.

    .venv/bin/python scripts/engine_work_probe.py --rounds 4 --out results/engine-work-s49

A raw profile is measured first (engine/profiling.measure_raw, as a first start does). Each round runs
`engine/overhead.engine_steps` (the real engine at 1 and 4 requests under plain decoding, MTP-1 and
fixed-3) and prices the steps two ways against the cached (raw) profile of the shipped drafter on the bf16 target:
as profile format 13 did — plain forwards, verify forwards and proposals each scaled by their median (forward +
commit) / profiled or (proposal + feed) / profiled ratio — and as `scheduling/engine_work.fit` does — the commit and
the feed as seconds, the proposal by its ratio. Reported per round: the verify step of 4 requests × 2 tokens (MTP-1)
and of 4 × 4 over the plain step of 4, and MTP-1's drafting at 4 requests, as each calibration prices them. What
varies between rounds is the pricing noise the scheduler's decisions inherit.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from dspark.bench.common import machine_info, markdown_table, write_results
from dspark.drafters import make_drafter
from dspark.engine import overhead
from dspark.engine.profiling import measure_raw, profile_key
from dspark.models import load_model
from dspark.scheduling.engine_work import fit, priced_in
from dspark.scheduling.live_profile import rescaled


def old_factors(samples, profile) -> dict[str, float]:
    """Format 13's three factors from the same steps."""
    ratio = {"plain": [], "verify": [], "draft": []}
    for s in samples:
        cls = "plain" if s.n_tokens == s.n_requests else "verify"
        ratio[cls].append((s.forward_s + s.commit_s) / float(profile.step_s(s.n_tokens, s.n_requests)))
        if s.drafted:
            ratio["draft"].append((s.draft_s + s.feed_s) / float(profile.draft_s(s.drafted, s.depth)))
    return {c: statistics.median(v) for c, v in ratio.items()}


def prices(profile) -> dict[str, float]:
    plain = float(profile.step_s(4, 4))
    return {"mtp1 / plain (R=4)": float(profile.step_s(8, 4)) / plain,
            "fixed-3 / plain (R=4)": float(profile.step_s(16, 4)) / plain,
            "drafting R=4 depth 2 (ms)": 1e3 * float(profile.draft_s(4, 2))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    model = load_model("smollm2-135m-instruct", dtype=args.dtype).model
    drafter = make_drafter("dspark", target=model, gamma=7)
    print("measuring the raw profile (a few minutes)", flush=True)
    raw = measure_raw(model, profile_key("smollm2-135m-instruct", args.dtype, drafter.profile_id, model), drafter)
    rows = []
    for i in range(args.rounds):
        t0 = time.perf_counter()
        samples = overhead.engine_steps(model, drafter, seed=i)
        f = old_factors(samples, raw)
        work = fit(samples, raw)
        for name, prof in (("factors (format 13)", rescaled(raw, **f)), ("seconds (format 14)", priced_in(raw, work))):
            rows.append({"round": i + 1, "calibration": name, **{k: round(v, 4) for k, v in prices(prof).items()},
                         "seconds": round(time.perf_counter() - t0, 1),
                         "fit": (f"plain x{f['plain']:.3f}, verify x{f['verify']:.3f}, draft x{f['draft']:.3f}"
                                 if name.startswith("factors") else work.describe())})
            print(rows[-1], flush=True)
    keys = ["mtp1 / plain (R=4)", "fixed-3 / plain (R=4)", "drafting R=4 depth 2 (ms)"]
    spread = []
    for name in ("factors (format 13)", "seconds (format 14)"):
        mine = [r for r in rows if r["calibration"] == name]
        spread.append([name, *(f"{min(r[k] for r in mine):.3f}–{max(r[k] for r in mine):.3f}" for k in keys)])
    md = ("# The engine-work calibration, repeated: what it prices (bf16 target, shipped drafter)\n\n"
          f"    .venv/bin/python scripts/engine_work_probe.py --rounds {args.rounds}"
          + (f" --out {args.out}" if args.out else "") + "\n\n"
          + markdown_table(["round", "calibration", *keys, "fit"],
                           [[r["round"], r["calibration"], *(r[k] for k in keys), r["fit"]] for r in rows])
          + "\n\nRange over the rounds:\n\n" + markdown_table(["calibration", *keys], spread) + "\n")
    print(md)
    if args.out:
        write_results(Path(args.out), "engine_work_probe", {"machine": machine_info(), "args": vars(args), "rows": rows}, md)


if __name__ == "__main__":
    main()
