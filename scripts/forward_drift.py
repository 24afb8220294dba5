"""Is this machine's speed steady? Repeat one identical batched decode forward for a while and report it in blocks.

Same tokens, same KV caches, same memory every time: any change in time is the machine, not the workload. On the
2-core dev VM the median per block switches between modes up to ~20 % apart for seconds at a time — why
`dspark bench serve` steps all policies' clients in turn instead of running one policy's cell after another.

    .venv/bin/python scripts/forward_drift.py --seconds 90 --requests 16 --out results/forward-drift
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from dspark.bench.common import machine_info
from dspark.models import load_model
from dspark.models.transformer import Segment


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--seconds", type=float, default=90.0)
    ap.add_argument("--requests", type=int, default=16, help="decoding requests in the batched forward")
    ap.add_argument("--block", type=int, default=25, help="forwards per reported block")
    ap.add_argument("--out", type=Path, default=Path("results/forward-drift"))
    args = ap.parse_args()

    model = load_model(args.model, dtype="float32").model
    torch.manual_seed(0)
    caches = []
    for r in range(args.requests):  # contexts of 150, 170, ... tokens, like a mixed serving batch
        cache, n = model.new_cache(1024), 150 + 20 * r
        model.forward(torch.randint(0, 1000, (n,)), [Segment(cache, 0, n)], logit_rows=torch.tensor([n - 1]))
        caches.append(cache)
    tokens = torch.randint(0, 1000, (args.requests,))

    def forward_ms() -> float:
        t0 = time.perf_counter()
        model.forward(tokens, [Segment(c, c.length, 1) for c in caches])
        for c in caches:
            c.truncate(c.length - 1)  # the same positions again next time
        return (time.perf_counter() - t0) * 1000

    for _ in range(5):
        forward_ms()
    blocks, start = [], time.perf_counter()
    while time.perf_counter() - start < args.seconds:
        times = [forward_ms() for _ in range(args.block)]
        blocks.append({"t_s": round(time.perf_counter() - start, 1), "median_ms": statistics.median(times),
                       "min_ms": min(times), "max_ms": max(times)})
        print(f"{blocks[-1]['t_s']:6.1f} s  median {blocks[-1]['median_ms']:6.1f} ms  "
              f"[{blocks[-1]['min_ms']:.1f}, {blocks[-1]['max_ms']:.1f}]", flush=True)
    medians = [b["median_ms"] for b in blocks]
    summary = {"blocks": len(blocks), "median_of_medians_ms": statistics.median(medians),
               "fastest_block_ms": min(medians), "slowest_block_ms": max(medians),
               "slowest_over_fastest": max(medians) / min(medians)}
    print(json.dumps(summary, indent=1))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "forward_drift.json").write_text(json.dumps(
        {"config": {k: str(v) for k, v in vars(args).items()}, "machine": machine_info(), "summary": summary,
         "blocks": blocks}, indent=1))
    (args.out / "forward_drift.md").write_text(
        f"# One identical {args.requests}-request decode forward, repeated for {args.seconds:g} s\n\n"
        "| blocks | median of block medians (ms) | fastest block | slowest block | slowest / fastest |\n"
        "|---|---|---|---|---|\n"
        f"| {len(blocks)} | {summary['median_of_medians_ms']:.1f} | {summary['fastest_block_ms']:.1f} | "
        f"{summary['slowest_block_ms']:.1f} | {summary['slowest_over_fastest']:.2f} |\n")
    plot(blocks, args.out / "forward_drift.png", args.requests)


def plot(blocks: list[dict], path: Path, requests: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    t = [b["t_s"] for b in blocks]
    ax.plot(t, [b["median_ms"] for b in blocks], marker=".", label="block median")
    ax.fill_between(t, [b["min_ms"] for b in blocks], [b["max_ms"] for b in blocks], alpha=0.2, label="min–max")
    ax.set_xlabel("seconds")
    ax.set_ylabel("ms per forward")
    ax.set_title(f"the same {requests}-request decode forward, over time")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
