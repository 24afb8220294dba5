"""Training features (the target's captured layers for a batch of whole sequences) through the two attention paths.

    .venv/bin/python scripts/features_cost.py --out results/features-s32
    .venv/bin/python scripts/features_cost.py --batches 8,32 --rounds 5

On a GPU, `compute_features` runs the target over whole sequences whose keys are not kept (`Segment(None, 0, n)`):
one padded attention call per layer for the batch. Per sequence (its own cache and attention call, the CPU's path
and the only one before session 32) a 30-layer target makes some 1,900 small operators a sequence, which a GPU
pays in launches. This times both on this machine (shuffled rounds, medians), counts their operators, and checks
that they agree.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from dspark.bench.common import machine_info, publish, shuffled_medians, timing_report
from dspark.models import load_model
from dspark.models.transformer import Segment

LAYERS = (1, 8, 14, 20, 27)


def run(model, seqs, cached: bool):
    segments = [Segment(model.new_cache(len(s)) if cached else None, 0, len(s)) for s in seqs]
    return model.forward(torch.cat(seqs), segments, logit_rows=torch.tensor([0]), hidden_layers=LAYERS)


def operators(fn) -> int:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batches", default="4,16")
    ap.add_argument("--lengths", default="100,400", help="sequence lengths drawn uniformly from this range")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    model = load_model(args.model).model
    lo, hi = (int(x) for x in args.lengths.split(","))
    rows, data = [], {"machine": machine_info(), "model": args.model, "layers": LAYERS, "rows": []}
    for b in (int(x) for x in args.batches.split(",")):
        g = torch.Generator().manual_seed(b)
        seqs = [torch.randint(0, 49_000, (int(n),), generator=g) for n in torch.randint(lo, hi + 1, (b,), generator=g)]
        ref, dense = run(model, seqs, True), run(model, seqs, False)
        diff = max(float((ref.hidden[i] - dense.hidden[i]).abs().max() / ref.hidden[i].abs().max()) for i in LAYERS)
        times = shuffled_medians({"per-sequence": lambda: run(model, seqs, True),
                                  "padded": lambda: run(model, seqs, False)}, args.rounds)
        ops = {"per-sequence": operators(lambda: run(model, seqs, True)),
               "padded": operators(lambda: run(model, seqs, False))}
        tokens = sum(len(s) for s in seqs)
        row = {"sequences": b, "tokens": tokens, "per_sequence_s": times["per-sequence"], "padded_s": times["padded"],
               "ops_per_sequence_path": ops["per-sequence"], "ops_padded": ops["padded"], "max_rel_diff": diff}
        data["rows"].append(row)
        rows.append([b, tokens, f"{times['per-sequence'] * 1e3:.0f}", f"{times['padded'] * 1e3:.0f}",
                     f"{times['per-sequence'] / times['padded']:.2f}", ops["per-sequence"], ops["padded"], f"{diff:.1e}"])
        print(rows[-1], flush=True)
    md = timing_report(f"Training features: per-sequence vs padded attention ({args.model}, layers {LAYERS})",
                       data["machine"], args.rounds, ["sequences", "tokens", "per-sequence ms", "padded ms", "speed-up",
                                                      "operators before", "operators after",
                                                      "max |Δ hidden| / max |hidden|"], rows)
    publish(args.out, "features", data, md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
