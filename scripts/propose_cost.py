"""What one batched `propose` costs: R requests with warm contexts, greedy vs sampled, at several depths.

    .venv/bin/python scripts/propose_cost.py --requests 32 --repeats 5
    .venv/bin/python scripts/propose_cost.py --requests 1 --repeats 9 --depths 1,2,3,4,7 --temperatures 0
    .venv/bin/python scripts/propose_cost.py --requests 1,4,16 --repeats 25 --depths 4,7 --ab-kernels \
        --after-target-step --out results/drafter-kernels
    .venv/bin/python scripts/propose_cost.py --requests 1,2,4,16 --repeats 25 --depths 2,4,7 --ab-bf16 \
        --after-target-step --out results/drafter-bf16
    .venv/bin/python scripts/propose_cost.py --requests 1,2,4 --repeats 25 --depths 1,4,7 --ab-native-rows 3,16 \
        --after-target-step --out results/drafter-native-rows
    .venv/bin/python scripts/propose_cost.py --requests 1,2,4,8 --repeats 30 --depths 1,2,3,7 --ab-backbone \
        --after-target-step --out results/drafter-states
    .venv/bin/python scripts/propose_cost.py --requests 1,8,32 --repeats 15 --depths 3,7 --ab-attention \
        --after-target-step --out results/drafter-attention-s32

Greedy batches carry no full-vocabulary distributions (point masses); `depth` is what a fixed-K policy asks for.
`--ab-kernels` times each proposal with the drafter's inference kernels (drafters/draft_kernels.py) and with its
reference nn.Linear products, in a shuffled order within one process; `--ab-bf16` likewise with the kernels in
fp32 and with bf16 products (draft_kernels.py: bf16 LM head, bf16 projections from 3 rows up; where only our bf16
C kernel is fast, AVX2, both up to BF16_C_ROWS rows); `--ab-native-rows
A,B` with our C kernel serving the drafter's fp32 projections and head up to A, then B rows (kernel_choice.py);
`--ab-backbone` the inference backbone (`DSparkModel.draft_states`) against the whole block through `backbone`;
`--ab-attention` drafting's one fused block-attention call against the grouped products (dspark_attention.py).
`--after-target-step` runs a one-token target forward before every proposal, as an engine step does, so the
drafter's weights are no longer in cache (a proposal repeated back to back reads them warm and looks cheaper than
it is in the engine).
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import torch

from dspark.bench.common import machine_info, markdown_table, write_results
from dspark.decoding import SamplingParams, make_generator
from dspark.drafters import draft_kernels, make_drafter
from dspark.drafters.base import DraftRequest
from dspark.drafters.frozen_target import inference_head
from dspark.models import load_model
from dspark.models.transformer import Segment


def observed_requests(model, drafter, n: int, temperature: float) -> list[DraftRequest]:
    """n requests with contexts of 150, 160, ... tokens, observed once."""
    torch.manual_seed(0)
    reqs = []
    for r in range(n):
        length = 150 + 10 * r
        ids = torch.randint(0, 1000, (length,))
        out = model.forward(ids, [Segment(model.new_cache(length + 8), 0, length)],
                            logit_rows=torch.tensor([length - 1]), hidden_layers=drafter.needs_layers)
        req = DraftRequest(tokens=ids.tolist() + [5], params=SamplingParams(temperature=temperature),
                           generator=make_generator(r))
        drafter.observe(req, out.hidden, length)
        reqs.append(req)
    return reqs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--drafter", default="dspark")
    ap.add_argument("--requests", default="32", help="comma-separated request counts")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--depths", default="7,3,1", help="comma-separated draft depths")
    ap.add_argument("--temperatures", default="0,1", help="comma-separated sampling temperatures")
    ap.add_argument("--ab-kernels", action="store_true", help="kernels on vs the reference products, interleaved")
    ap.add_argument("--ab-bf16", action="store_true", help="fp32 kernels vs bf16 products, interleaved")
    ap.add_argument("--ab-native-rows", default=None, help="comma-separated C-kernel row limits to compare")
    ap.add_argument("--ab-backbone", action="store_true",
                    help="draft_states (inference path) vs the whole block through the training backbone")
    ap.add_argument("--ab-attention", action="store_true", help="one fused attention call vs the grouped products")
    ap.add_argument("--after-target-step", action="store_true", help="a one-token target forward before each")
    ap.add_argument("--out", type=Path, default=None, help="write propose_cost.json / .md here")
    args = ap.parse_args()
    model = load_model(args.model, dtype="float32").model
    drafter = make_drafter(args.drafter, target=model, gamma=7)
    modes = mode_setters(drafter, model, args)
    cache, rng, rows = model.new_cache(64), random.Random(0), []

    for temperature in map(float, args.temperatures.split(",")):
        for n in map(int, args.requests.split(",")):
            reqs = observed_requests(model, drafter, n, temperature)
            cells = [(mode, depth) for mode in modes for depth in map(int, args.depths.split(","))]
            times: dict = {cell: [] for cell in cells}
            for rep in range(args.repeats + 1):  # the first round warms up
                for mode, depth in rng.sample(cells, len(cells)):
                    modes[mode]()
                    if args.after_target_step:
                        cache.truncate(0)
                        model.forward(torch.tensor([5]), [Segment(cache, 0, 1)])
                    t0 = time.perf_counter()
                    drafter.propose(reqs, depth=depth)
                    if rep:
                        times[(mode, depth)].append((time.perf_counter() - t0) * 1000)
            next(iter(modes.values()))()
            for mode, depth in cells:
                ms = statistics.median(times[(mode, depth)])
                rows.append({"temperature": temperature, "requests": n, "depth": depth, "mode": mode, "median_ms": ms})
                print(f"T = {temperature:g}  depth {depth}  {n} requests  {mode:9s}: median {ms:6.2f} ms "
                      f"({torch.get_num_threads()} threads)", flush=True)
    if args.out is not None:
        write_results(args.out, "propose_cost", {"machine": machine_info(), "args": vars(args) | {"out": str(args.out)},
                                                 "rows": rows}, _markdown(rows, args))


def mode_setters(drafter, model, args) -> dict:
    """name -> a function putting the drafter in that mode; the first is the default (what `propose` runs)."""
    if sum(map(bool, (args.ab_kernels, args.ab_bf16, args.ab_native_rows, args.ab_backbone, args.ab_attention))) > 1:
        raise SystemExit("--ab-kernels, --ab-bf16, --ab-native-rows, --ab-backbone and --ab-attention are separate "
                         "comparisons: pick one")
    if args.ab_attention:
        return _attention_setters()
    if args.ab_backbone:
        return _backbone_setters(drafter)
    if args.ab_native_rows:
        return {f"rows<={n}": _rows_setter(drafter, int(n)) for n in args.ab_native_rows.split(",")}
    if args.ab_bf16:
        packed, native, rows = model.lm_head.packed is not None, model.lm_head.native, model.lm_head.native_rows
        modes = {}
        for name, bf16 in (("bf16", True), ("fp32", False)):  # bf16 as DSparkDrafter builds it (AVX2: few rows)
            c_rows = draft_kernels.bf16_c_rows() if bf16 and native else None
            draft_kernels.attach(drafter.model, packed=packed, native=native, bf16=bf16, native_rows=rows,
                                 c_rows=c_rows)
            kernels = {m: m.__dict__["fast_linears"] for m in drafter.model.modules() if "fast_linears" in m.__dict__}
            modes[name] = _setter(drafter, kernels, inference_head(drafter.model, model, bf16, c_rows))
        return modes
    attached = {m: m.__dict__["fast_linears"] for m in drafter.model.modules() if "fast_linears" in m.__dict__}
    if args.ab_kernels and not attached:
        raise SystemExit("--ab-kernels: this drafter has no inference kernels attached (DSPARK_NATIVE=0 or no oneDNN)")
    modes = {"kernels": _setter(drafter, attached, drafter.draft_logits)} if attached else {}
    if args.ab_kernels or not attached:
        modes["reference"] = _setter(drafter, {m: None for m in attached}, drafter.draft_logits)
    return modes


def _backbone_setters(drafter) -> dict:
    """`draft_states` against the training path it replaced: every slot of the whole block through
    `backbone`, then the first `keep` kept."""
    model = drafter.model

    def whole_block(anchor_ids, anchors, ctx_kv, visible, keep):
        block_ids = torch.full((len(anchor_ids), 1, model.arch.block_size), model.arch.mask_token_id)
        block_ids[:, 0, 0] = anchor_ids
        return model.backbone(block_ids, anchors[:, None], ctx_kv, visible)[:, 0, :keep]

    def fast() -> None:
        model.__dict__.pop("draft_states", None)

    def reference() -> None:
        model.__dict__["draft_states"] = whole_block
    return {"draft_states": fast, "whole block": reference}


def _attention_setters() -> dict:
    from dspark.drafters import dspark_attention, dspark_model

    def one_call() -> None:
        dspark_model.block_attention = dspark_attention.block_attention

    def grouped() -> None:
        dspark_model.block_attention = dspark_attention.grouped_block_attention
    return {"one call": one_call, "grouped": grouped}


def _rows_setter(drafter, limit: int):
    projections = [fast.projection for m in drafter.model.modules()
                   for fast in m.__dict__.get("fast_linears", {}).values()]
    head = getattr(drafter.draft_logits, "projection", None)
    if not projections and head is None:
        raise SystemExit("--ab-native-rows: this drafter runs no projection through our kernels")

    def set_mode() -> None:
        for p in projections + ([head] if head is not None else []):
            p.native_rows = limit
    return set_mode


def _setter(drafter, kernels: dict, head):
    def set_mode() -> None:
        drafter.draft_logits = head
        for module, fast in kernels.items():
            if fast is None:
                module.__dict__.pop("fast_linears", None)
            else:
                module.__dict__["fast_linears"] = fast
    return set_mode


def _markdown(rows: list[dict], args) -> str:
    by = {(r["temperature"], r["requests"], r["depth"], r["mode"]): r["median_ms"] for r in rows}
    names = list(dict.fromkeys(r["mode"] for r in rows))  # first: the default path; last: what it is compared with
    keys = sorted({k[:3] for k in by})
    ratio = f"{names[-1]} / {names[0]}"
    table = [[t, n, d, *(by.get((t, n, d, m), "–") for m in names),
              by[(t, n, d, names[-1])] / by[(t, n, d, names[0])] if len(names) > 1 else "–"] for t, n, d in keys]
    cold = "after a one-token target step (weights cold)" if args.after_target_step else "back to back (weights warm)"
    return (f"# propose() cost, median ms over {args.repeats} repeats, {cold}\n\n"
            + markdown_table(["T", "requests", "depth", *names, ratio], table) + "\n")

if __name__ == "__main__":
    main()
