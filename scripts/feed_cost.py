"""What having a drafter costs the engine on steps that draft nothing: plain decoding without a drafter against
the async scheduler under load (it skips the drafter but still captures and keeps the target states the drafter
will need), decode-only steps of the same requests, engines stepped in alternating order.

    .venv/bin/python scripts/feed_cost.py --concurrency 32 --out results/feed-cost-s23/after.txt
    PYTHONPATH=<older checkout>/src .venv/bin/python scripts/feed_cost.py --concurrency 32 --out .../before.txt
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import dspark.engine.engine as engine_module
from dspark.bench.serving import ServeBenchConfig, setup
from dspark.scheduling.registry import make_policy


def _timed(store: dict, key: str, fn):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        store.setdefault(key, []).append(time.perf_counter() - t0)
        return out
    return wrapper


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=12, help="blocks of --steps steps per engine")
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--compact-every", type=int, default=None, help="the feed's compaction interval (default: its own)")
    ap.add_argument("--never-draft", action="store_true",
                    help="the drafter-loaded engine never drafts (policy none): what capturing and keeping costs")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    cfg = ServeBenchConfig(model="smollm2-135m-instruct", drafter="dspark", policies=("none", "async"),
                           concurrency=(args.concurrency,), max_new_tokens=400)
    _, _, prompts, params, engines = setup(cfg)
    if args.compact_every:
        engines["async"].feed.compact_every = args.compact_every
    if args.never_draft:
        engines["async"].policy = make_policy("none")
    times: dict[str, list[float]] = {}
    # The engines share one model and one plan_step: time them under the name of the engine stepping.
    stepping = {"name": ""}
    real_forward, real_plan = engines["none"].model.forward, engine_module.plan_step

    def forward(*args, **kwargs):
        return _timed(times, f"{stepping['name']} forward", real_forward)(*args, **kwargs)

    def plan(*args, **kwargs):
        return _timed(times, f"{stepping['name']} plan", real_plan)(*args, **kwargs)

    engines["none"].model.forward, engine_module.plan_step = forward, plan
    for name, engine in engines.items():
        engine.step = _timed(times, f"{name} step", lambda name=name, step=engine.step: (
            stepping.update(name=name), step())[1])
        engine._commit_decoding = _timed(times, f"{name} commit", engine._commit_decoding)
        if engine.drafter is not None:
            engine.feed.stash = _timed(times, f"{name} stash", engine.feed.stash)
        for p in prompts[: args.concurrency]:
            engine.add_request(p, params)
        while engine.waiting or any(r.status.name != "DECODE" for r in engine.running):
            engine.step()
    times.clear()  # decode-only steps from here
    order = list(engines.items())
    for block in range(args.blocks):
        for name, engine in (order if block % 2 == 0 else order[::-1]):
            for _ in range(args.steps):
                engine.step()
    lines = [f"decode-only steps at C = {args.concurrency} ({args.blocks} blocks of {args.steps}), "
             f"{len(engines['none'].running)} requests still running; median µs per step"]
    lines[0] += " (and mean)"
    lines += [f"{key:16s} {1e6 * statistics.median(v):9.1f} {1e6 * statistics.mean(v):9.1f}"
              for key, v in sorted(times.items())]
    ratio = statistics.median(times["async step"]) / statistics.median(times["none step"])
    lines.append(f"async / none step: {ratio:.4f}")
    print("\n".join(lines))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
