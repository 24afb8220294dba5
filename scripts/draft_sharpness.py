"""Would drafting from a sharper or flatter q raise acceptance at T = 1? (It would stay lossless: verification
takes whatever q the drafts were sampled from.)

    .venv/bin/python scripts/draft_sharpness.py --prompts .dev/heldout.jsonl --limit 40 \
        --out results/draft-sharpness-s36

Runs the shipped DSpark drafter with every draft verified (γ = 7, T = 1) on held-out prompts, and at every slot a
round reached records the drafter's logits (Markov bias included) and the target's distribution there. Slot k's
chance of acceptance when drafting from q_β ∝ exp(β · logits) is Σ_v min(p(v), q_β(v)); the script averages it
over the reached slots for each β. The drafts themselves were sampled at β = 1, so for slots after the first the
contexts are those β = 1 reaches; slot 1 is exact. No benchmark prompt is read.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

import dspark.drafters.dspark as dspark_module
from dspark.decoding import SamplingParams
from dspark.drafters import make_drafter
from dspark.engine import Generation, TransformerTarget
from dspark.models import load_model

BETAS = (0.7, 0.85, 1.0, 1.15, 1.3, 1.5, 2.0)


class Recorder(TransformerTarget):
    """Keeps the last forward's logits: in a round, the target's rows for the anchor and every draft."""

    def forward(self, state, start, tokens, last_only=False):
        self.last = super().forward(state, start, tokens, last_only)
        return self.last


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", default=".dev/heldout.jsonl", help="JSONL with turns (scripts/device_prepare.sh)")
    ap.add_argument("--limit", type=int, default=40)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    loaded = load_model()
    tok, drafter = loaded.tokenizer, make_drafter("dspark", target=loaded.model, gamma=7)
    to_full = drafter.model.to_full(torch.arange(drafter.model.draft_vocab_size))  # [Vd] target ids
    slot_logits: list[torch.Tensor] = []
    draw = dspark_module.draw

    def recording_draw(logits, requests, probs, k):  # slot k's logits [1, Vd] as the drafter samples from them
        if k == 0:
            slot_logits.clear()
        slot_logits.append(logits[0].clone())
        return draw(logits, requests, probs, k)

    dspark_module.draw = recording_draw
    texts = [json.loads(line)["turns"][0] for line in open(args.prompts, encoding="utf-8")][: args.limit]
    overlap: dict[int, list[list[float]]] = {}
    for i, text in enumerate(texts):
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        target = Recorder(loaded.model, hidden_layers=drafter.needs_layers)
        gen = Generation(target, drafter, ids, SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens,
                                                               seed=i), loaded.eos_ids)
        rounds = 0
        for _ in gen:
            if gen.stats.rounds == rounds:
                continue  # the prefill's token
            rounds = gen.stats.rounds
            p = torch.softmax(target.last.float(), -1)  # [n + 1, V]
            reached = min(gen.stats.accepted_per_round[-1] + 1, len(slot_logits), p.shape[0] - 1)
            for k in range(reached):
                pk = p[k][to_full]  # [Vd]: q puts no mass outside the draft vocabulary
                overlap.setdefault(k + 1, []).append(
                    [float(torch.minimum(pk, torch.softmax(slot_logits[k] * b, -1)).sum()) for b in BETAS])
    dspark_module.draw = draw
    rows = [{"slot": k, "reached": len(v), **{f"beta_{b}": round(float(m), 4) for b, m in zip(BETAS, np.mean(v, 0))}}
            for k, v in sorted(overlap.items()) if len(v) >= 20]
    title = f"Acceptance chance at each slot when drafting from q^β (T = 1, {len(texts)} prompts of {args.prompts})"
    lines = [f"# {title}",
             "", "| slot | reached | " + " | ".join(f"β = {b}" for b in BETAS) + " |",
             "|---|---|" + "---|" * len(BETAS)]
    lines += [f"| {r['slot']} | {r['reached']} | " + " | ".join(str(r[f"beta_{b}"]) for b in BETAS) + " |"
              for r in rows]
    print("\n".join(lines))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        meta = {"prompts": args.prompts, "limit": args.limit, "max_new_tokens": args.max_new_tokens,
                "date": time.strftime("%Y-%m-%dT%H:%M:%S")}
        (out / "draft_sharpness.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        (out / "draft_sharpness.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
