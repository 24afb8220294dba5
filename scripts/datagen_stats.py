"""What a datagen output holds: conversations, answer tokens, finish reasons and prompt sources.

    .venv/bin/python scripts/datagen_stats.py results/training/gpu-s32/data.jsonl.xz
    .venv/bin/python scripts/datagen_stats.py results/training/gpu-s32/data.jsonl.xz --lines 1-2048,4097-6144

`--lines` counts only those 1-based line ranges (e.g. the part of a concatenated file one run trained on).
"""
from __future__ import annotations

import argparse
import collections
import json
import lzma


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("path", help="data.jsonl or data.jsonl.xz (datagen records)")
    ap.add_argument("--lines", default="", help="comma-separated 1-based ranges a-b (default: all)")
    args = ap.parse_args(argv)
    ranges = [tuple(int(x) for x in r.split("-")) for r in args.lines.split(",") if r]
    opener = lzma.open if args.path.endswith(".xz") else open
    convs, tokens, finish, sources = 0, 0, collections.Counter(), collections.Counter()
    with opener(args.path, "rt", encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if ranges and not any(a <= number <= b for a, b in ranges):
                continue
            r = json.loads(line)
            convs += 1
            tokens += sum(r.get("answer_tokens", []))
            finish.update(r.get("finish_reasons", []))
            sources[(r.get("source") or "?").split(":")[0]] += 1
    print(json.dumps({"conversations": convs, "answer_tokens": tokens, "finish_reasons": dict(finish),
                      "sources": dict(sources)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
