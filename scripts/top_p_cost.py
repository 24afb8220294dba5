"""What does verifying a sampled step cost? decoding/batch.verify_requests as it is now — top-p from the most
likely 256, then 4,096 tokens of a row; requests that process alike sharing to_probs calls of about 4 rows;
sampling by a two-level CDF search — against the same path with one to_probs call per request
(CHUNK_ELEMENTS = 1), and against the session-29 path, restored here: a full sort of every row for top-p, one
to_probs per request into a zeroed buffer, an fp64 cumsum of every row to sample (verify() itself and verify_requests' indexing are
today's in all three paths). On real SmolLM2-135M logits.
(results/top-p-s31-per-request: commit a4c91bb, one call per request, while a shared call still gave a row other
last bits than its own; top-p now normalises along each row alone, so both give the same tokens, checked here.)

    .venv/bin/python scripts/top_p_cost.py [--requests 1,8,32] [--drafts 1,3] [--top-p 1,0.95,0.9] [--out DIR]

The logits are the target's rows along sampled answers (T = 1) to a few prompts; each request of a step takes
ℓ + 1 of them. Every request has its own seed (seeded requests, or a server's n choices). Prints the mean time
per step of each path (median over repeats), checks all three verified the same tokens, and writes top_p.json +
top_p.md.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from importlib import import_module
from pathlib import Path
from unittest import mock

import torch

import dspark.decoding.batch as batch
import dspark.decoding.sampling as sampling
from dspark.bench.common import machine_info
from dspark.decoding import SamplingParams, make_generator
from dspark.models import Segment, load_model

verify = import_module("dspark.decoding.verify")  # the module: the package's `verify` is its function

PROMPTS = ["Write a short story about a robot learning to paint.", "Explain how binary search works, with code.",
           "What is 17 * 23? Show your steps.", "List five fruits and describe their colors."]


def full_sort_top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Session 29's rule: sort the whole row."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    drop_sorted = sorted_p.cumsum(-1) - sorted_p >= top_p
    kept = probs.masked_fill(torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted), 0.0)
    return kept / kept.sum(-1, keepdim=True)


def per_request_rows(blocks, params, width):
    """Session 29's buffer: zeros, each request's rows processed on their own."""
    rows = torch.zeros(len(blocks), width + 1, blocks[0].shape[-1])
    for i, (block, p) in enumerate(zip(blocks, params)):
        rows[i, : block.shape[0]] = sampling.to_probs(block, p)
    return rows


def full_cdf_sample(probs, uniforms):
    cdf = probs.double().cumsum(-1)
    tokens = torch.searchsorted(cdf, (uniforms.double() * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
    return tokens.clamp_(max=probs.shape[-1] - 1)


def real_rows(model_name: str, per_prompt: int) -> torch.Tensor:
    loaded = load_model(model_name)
    rows, g = [], torch.Generator().manual_seed(0)
    for text in PROMPTS:
        ids = loaded.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                   tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        cache = loaded.model.new_cache()
        logits = loaded.model.forward(torch.tensor(ids), [Segment(cache, 0, len(ids))]).logits[-1]
        for _ in range(per_prompt):
            rows.append(logits.float())
            ids.append(int(torch.multinomial(torch.softmax(logits.float(), -1), 1, generator=g)))
            logits = loaded.model.forward(torch.tensor(ids[-1:]), [Segment(cache, len(ids) - 1, 1)]).logits[-1]
    return torch.stack(rows)  # [N, V]


def step_inputs(rows: torch.Tensor, requests: int, drafts: int, top_p: float):
    vocab, g = rows.shape[-1], torch.Generator().manual_seed(1)
    logits = [rows[(r * (drafts + 1) + torch.arange(drafts + 1)) % len(rows)] for r in range(requests)]
    tokens = torch.stack([torch.multinomial(torch.softmax(x[:drafts], -1), 1, generator=g)[:, 0] for x in logits])
    q = torch.softmax(torch.stack([x[:drafts] for x in logits]) + torch.randn(requests, drafts, vocab, generator=g),
                      -1)  # a drafter close to the target
    params = [SamplingParams(temperature=1.0, top_p=top_p, seed=r) for r in range(requests)]
    return logits, tokens, torch.full((requests,), drafts), q, params, torch.zeros(requests, drafts, dtype=torch.bool)


def time_step(inputs, calls: int) -> tuple[float, object]:
    logits, tokens, num, q, params, stops = inputs
    spent, result = [], None
    for i in range(calls):
        gens = [make_generator(1000 * i + r) for r in range(len(params))]
        t0 = time.perf_counter()
        result = batch.verify_requests(logits, tokens, num, q, params, gens, stops)
        spent.append(time.perf_counter() - t0)
    return statistics.mean(spent), result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--requests", default="1,8,32")
    ap.add_argument("--drafts", default="1,3")
    ap.add_argument("--top-p", default="1,0.95,0.9")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    rows, table = real_rows(args.model, 32), []
    for top_p in [float(x) for x in args.top_p.split(",")]:
        for drafts in [int(x) for x in args.drafts.split(",")]:
            for requests in [int(x) for x in args.requests.split(",")]:
                inputs = step_inputs(rows, requests, drafts, top_p)
                calls = max(3, 48 // requests)
                new, alone, old = [], [], []
                for _ in range(args.repeats):  # interleaved, so drift hits all three
                    t, ours = time_step(inputs, calls)
                    new.append(t)
                    with mock.patch.object(batch, "CHUNK_ELEMENTS", 1):  # a call per request, else the same path
                        t, own = time_step(inputs, calls)
                    alone.append(t)
                    assert all(torch.equal(getattr(ours, f), getattr(own, f)) for f in ("accepted", "next_token"))
                    with mock.patch.object(sampling, "_top_p", full_sort_top_p), \
                            mock.patch.object(batch, "_sampled_rows", per_request_rows), \
                            mock.patch.object(verify, "sample_from", full_cdf_sample):
                        t, ref = time_step(inputs, calls)
                    old.append(t)
                    assert all(torch.equal(getattr(ours, f), getattr(ref, f)) for f in ("accepted", "next_token"))
                row = {"top_p": top_p, "drafts": drafts, "requests": requests,
                       "ms": round(statistics.median(new) * 1e3, 2),
                       "per_request_calls_ms": round(statistics.median(alone) * 1e3, 2),
                       "reference_ms": round(statistics.median(old) * 1e3, 2)}
                row["speedup"] = round(row["reference_ms"] / row["ms"], 1)
                table.append(row)
                print(row, flush=True)
    lines = ["| top-p | drafts per request | requests | verify ms | one call per request ms | session-29 path ms | "
             "ratio to session 29 |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['top_p']:g} | {r['drafts']} | {r['requests']} | {r['ms']} | {r['per_request_calls_ms']} | "
              f"{r['reference_ms']} | {r['speedup']} |" for r in table]
    print("\n".join(lines))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        (args.out / "top_p.json").write_text(json.dumps({"settings": settings, "machine": machine_info(),
                                                        "rows": table}, indent=1))
        (args.out / "top_p.md").write_text(f"# Verification of a sampled step, T = 1 (`scripts/top_p_cost.py "
                                           f"--requests {args.requests} --drafts {args.drafts} --top-p {args.top_p}`)"
                                           "\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
