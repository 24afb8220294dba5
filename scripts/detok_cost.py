"""What does streaming the text cost per engine step? The windowed decode (engine/detok.py) against decoding the
whole output every step (the reference it replaced), over outputs of several lengths.

    .venv/bin/python scripts/detok_cost.py [--lengths 64,512,2048,4096] [--per-step 2] [--repeats 5]

Each run streams one output of N tokens (a real text, re-encoded and repeated to length) in steps of
``--per-step`` tokens (τ: the tokens one speculative step emits), timing every update; prints the mean cost
per step of each method (median over repeats) and checks both streamed the same text.
"""
from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

from dspark.engine.detok import update_text
from dspark.models import load_model

TEXT = ("The quick brown fox jumps over the lazy dog. Naïve café — 日本語のテキスト 🙂; def f(a):\n"
        "    return a * 2  # doubles\n\nQuestion: what is 17 × 23? Answer: 391.\n")


def whole_decode_update(req, tok) -> str:
    """The reference: decode everything, stream what is new (split characters held back)."""
    full = tok.decode(req.output, skip_special_tokens=True)
    if full.endswith("\ufffd"):
        return ""
    piece, req.text = full[len(req.text):], full
    return piece


def run(ids: list[int], per_step: int, tok, windowed: bool) -> tuple[float, str]:
    req = SimpleNamespace(output=[], text="", text_tokens=0, text_window=0, stop_strings=())
    spent, steps = 0.0, 0
    for at in range(0, len(ids), per_step):
        req.output.extend(ids[at:at + per_step])
        t0 = time.perf_counter()
        if windowed:
            update_text(req, tok, len(ids[at:at + per_step]))
        else:
            whole_decode_update(req, tok)
        spent += time.perf_counter() - t0
        steps += 1
    return spent / steps, req.text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--lengths", default="64,512,2048,4096")
    ap.add_argument("--per-step", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    tok = load_model(args.model).tokenizer
    base = tok.encode(TEXT, add_special_tokens=False)
    print(f"| output tokens | whole decode, µs/step | windowed, µs/step | ratio |\n|---|---|---|---|")
    for n in (int(x) for x in args.lengths.split(",")):
        ids = (base * (n // len(base) + 1))[:n]
        cost, texts = {}, set()
        for windowed in (False, True):
            samples = [run(ids, args.per_step, tok, windowed) for _ in range(args.repeats)]
            cost[windowed] = statistics.median(s for s, _ in samples) * 1e6
            texts |= {t for _, t in samples}
        assert len(texts) == 1, "the windowed decode streamed another text than the whole decode"
        print(f"| {n} | {cost[False]:.1f} | {cost[True]:.1f} | {cost[False] / cost[True]:.1f}x |")


if __name__ == "__main__":
    main()
