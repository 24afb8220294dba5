"""The drafter's block attention while drafting (one block per request): grouped products vs one fused call.

    .venv/bin/python scripts/block_attention_cost.py --out results/block-attention-s32

SmolLM2's drafter shapes (9 heads, 3 KV heads, head 64, γ + 1 = 8 slots), R requests with padded contexts of T
tokens (a tenth of them invisible, as padding is): `grouped_block_attention` (four einsums and one softmax; the
training path and the reference) against `one_block_attention` (one scaled_dot_product_attention over
[context ; block] keys), medians of shuffled rounds, with their largest difference.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from dspark.bench.common import machine_info, publish, shuffled_medians, timing_report
from dspark.drafters.dspark_attention import grouped_block_attention, one_block_attention


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="1x300,8x600,32x600", help="requests x context tokens, comma-separated")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    H, kvH, hd, S = 9, 3, 64, 8
    data, rows = {"machine": machine_info(), "rows": []}, []
    for shape in args.shapes.split(","):
        R, T = (int(x) for x in shape.split("x"))
        g = torch.Generator().manual_seed(R * 1000 + T)
        q = torch.randn(R, 1, S, H, hd, generator=g)
        kb, vb = (torch.randn(R, 1, S, kvH, hd, generator=g) for _ in range(2))
        kc, vc = (torch.randn(R, T, kvH, hd, generator=g) for _ in range(2))
        visible = torch.rand(R, 1, T, generator=g) < 0.9
        call = {"grouped": lambda: grouped_block_attention(q, kb, vb, kc, vc, visible, hd ** -0.5),
                "one call": lambda: one_block_attention(q, kb, vb, kc, vc, visible, hd ** -0.5)}
        diff = float((call["grouped"]() - call["one call"]()).abs().max())
        t = shuffled_medians(call, args.rounds)
        data["rows"].append({"requests": R, "context": T, "grouped_ms": t["grouped"] * 1e3,
                             "one_call_ms": t["one call"] * 1e3, "max_abs_diff": diff})
        rows.append([R, T, f"{t['grouped'] * 1e3:.2f}", f"{t['one call'] * 1e3:.2f}",
                     f"{t['grouped'] / t['one call']:.2f}", f"{diff:.1e}"])
        print(rows[-1], flush=True)
    md = timing_report("Drafting block attention, one layer: grouped products vs one fused call", data["machine"],
                       args.rounds, ["requests", "context", "grouped ms", "one call ms", "speed-up", "max |Δ|"], rows)
    publish(args.out, "block_attention", data, md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
