"""What one decoded token's attention costs outside our C kernel (a bf16 target), and the target step around it.

Times, for SmolLM2's shapes (9 query heads over 3 kv heads, head_dim 64, 257 keys), torch's attention of one query
with grouped heads (`enable_gqa`, the path used until session 34) against the same query's heads attended as rows of
their kv head (`Transformer._one_query_attention`), in fp32 and bf16; then the bf16 target's one-token step with
each path (`--context` tokens cached) and, where it could be built, with our C kernel, which attends bf16 caches
since session 35. Medians; writes JSON + Markdown to --out.

    .venv/bin/python scripts/one_query_attention_cost.py --out results/one-query-attention-s34
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from dspark.bench.common import median_seconds
from dspark.models.loader import load_model
from dspark.models.transformer import Segment


def median_us(fn, repeats: int) -> float:
    return 1e6 * median_seconds(fn, repeats, warmup=20)


def kernel_rows(repeats: int) -> list[dict]:
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        g = torch.Generator().manual_seed(0)
        q = torch.randn(1, 9, 1, 64, generator=g).to(dtype)  # [1, H, 1, hd]
        k, v = (torch.randn(1, 3, 257, 64, generator=g).to(dtype) for _ in range(2))  # [1, kvH, T, hd]
        grouped = q.view(1, 3, 3, 64)  # [1, kvH, H / kvH, hd]
        rows.append({"dtype": str(dtype).removeprefix("torch."),
                     "gqa_us": median_us(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), repeats),
                     "rows_of_kv_head_us": median_us(lambda: F.scaled_dot_product_attention(grouped, k, v), repeats)})
    return rows


def step_rows(context: int, repeats: int) -> list[dict]:
    model = load_model(dtype="bfloat16").model
    cache = model.new_cache(context + 8)
    model.forward(torch.arange(context) % 1000, [Segment(cache, 0, context)])
    token = torch.zeros(1, dtype=torch.long)

    def step():
        model.forward(token, [Segment(cache, context, 1)])
        cache.truncate(context)

    kernel, model.native_attention = model.native_attention, False  # the torch paths first
    fast = model._one_query_attention
    out = [{"path": "rows of the kv head", "ms": median_us(step, repeats) / 1000}]
    # The old path: every one-token segment through torch's grouped-query attention.
    model._one_query_attention = lambda q, keys, values, mask: F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), keys, values, attn_mask=mask, scale=model.config.query_scale,
        enable_gqa=True)[0].transpose(0, 1)
    out.insert(0, {"path": "enable_gqa (before)", "ms": median_us(step, repeats) / 1000})
    model._one_query_attention = fast
    if kernel:
        model.native_attention = True
        out.append({"path": "our C kernel", "ms": median_us(step, repeats) / 1000})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", type=Path, default=Path("results/one-query-attention"))
    args = ap.parse_args()
    data = {"threads": torch.get_num_threads(), "torch": torch.__version__, "context": args.context,
            "attention": kernel_rows(20 * args.repeats), "bf16_step": step_rows(args.context, args.repeats)}
    md = ["| dtype | one query, enable_gqa (µs) | as rows of the kv head (µs) |", "|---|---|---|"]
    md += [f"| {r['dtype']} | {r['gqa_us']:.1f} | {r['rows_of_kv_head_us']:.1f} |" for r in data["attention"]]
    md += ["", f"bf16 SmolLM2 one-token step, {args.context} tokens cached (ms):", "", "| path | ms |", "|---|---|"]
    md += [f"| {r['path']} | {r['ms']:.2f} |" for r in data["bf16_step"]]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "one_query_attention.json").write_text(json.dumps(data, indent=2) + "\n")
    (args.out / "one_query_attention.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
