"""What one batched `propose` costs: R requests with warm contexts, greedy vs sampled, at several depths.

    .venv/bin/python scripts/propose_cost.py --requests 32 --repeats 5
    .venv/bin/python scripts/propose_cost.py --requests 1 --repeats 9 --depths 1,2,3,4,7 --temperatures 0

Greedy batches carry no full-vocabulary distributions (point masses); `depth` is what a fixed-K policy asks for.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from dspark.decoding import SamplingParams, make_generator
from dspark.drafters import make_drafter
from dspark.drafters.base import DraftRequest
from dspark.models import load_model
from dspark.models.transformer import Segment


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--drafter", default="dspark")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--depths", default="7,3,1", help="comma-separated draft depths")
    ap.add_argument("--temperatures", default="0,1", help="comma-separated sampling temperatures")
    args = ap.parse_args()
    model = load_model(args.model, dtype="float32").model
    drafter = make_drafter(args.drafter, target=model, gamma=7)
    torch.manual_seed(0)
    contexts = []
    for r in range(args.requests):  # contexts of 150, 160, ... tokens, observed once
        n = 150 + 10 * r
        ids = torch.randint(0, 1000, (n,))
        out = model.forward(ids, [Segment(model.new_cache(n + 8), 0, n)], logit_rows=torch.tensor([n - 1]),
                            hidden_layers=drafter.needs_layers)
        contexts.append((ids.tolist(), out.hidden))

    def requests(temperature: float) -> list[DraftRequest]:
        reqs = []
        for i, (ids, hidden) in enumerate(contexts):
            req = DraftRequest(tokens=ids + [5], params=SamplingParams(temperature=temperature),
                               generator=make_generator(i))
            drafter.observe(req, hidden, len(ids))
            reqs.append(req)
        return reqs

    for temperature in map(float, args.temperatures.split(",")):
        reqs = requests(temperature)
        for depth in map(int, args.depths.split(",")):
            drafter.propose(reqs, depth=depth)  # warm-up
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                drafter.propose(reqs, depth=depth)
                times.append((time.perf_counter() - t0) * 1000)
            print(f"T = {temperature:g}  depth {depth}  {args.requests} requests: median {statistics.median(times):6.1f} ms "
                  f"({torch.get_num_threads()} threads)")


if __name__ == "__main__":
    main()
