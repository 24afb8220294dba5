"""What the context costs a verify step, and how the speed profile prices it with and without its context prices.

    .venv/bin/python scripts/context_cost.py --out results/context-s26
    .venv/bin/python scripts/context_cost.py --contexts 256,4096 --cells 1x8 --rounds 5

Times, in shuffled rounds, one forward of R requests verifying k tokens each with every request holding L tokens
of context (warm caches, as the profile's grid, which holds 256), for each L and (R, k); then prints beside each
what the cached profile of `--drafter` (measured with its prefill table if absent) prices the step at: its grid
alone (the price before profile format 11, the same at every L) and at_context(L) (the grid plus the context
prices). Then the same for a prompt chunk alone (`--chunk` tokens) that starts after S tokens of its prompt, for
each S in `--starts`: the prefill table's price (what a chunk from the start costs) and with the profile's price
of a later chunk.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from dspark.bench.common import machine_info, shuffled_medians, write_results
from dspark.engine.profiling import _step_fn, _warm_caches, load_or_profile, prefill_at_fn, profile_key


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--drafter", default="dspark")
    ap.add_argument("--contexts", default="64,256,512,1024,2048")
    ap.add_argument("--cells", default="1x1,1x2,1x8,4x1,4x8", help="R x k: R requests verifying k tokens each")
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--starts", default="0,512,1024,1536", help="prompt tokens before the timed chunk")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    from dspark.drafters import make_drafter
    from dspark.models import load_model

    loaded = load_model(args.model)
    model = loaded.model
    drafter = make_drafter(args.drafter, target=model)
    prof = load_or_profile(model, profile_key(args.model, "float32", drafter.profile_id, model), drafter=drafter,
                           prefill=True)
    contexts = [int(x) for x in args.contexts.split(",")]
    cells = [tuple(int(v) for v in c.split("x")) for c in args.cells.split(",")]
    jobs = {}
    for ctx in contexts:
        run = _step_fn(model, _warm_caches(model, ctx), ctx)
        for r, k in cells:
            jobs[(ctx, r, k)] = lambda run=run, r=r, k=k: run([k] * r)
    starts = [int(x) for x in args.starts.split(",")]
    for start in starts:
        jobs[("chunk", start)] = lambda run=prefill_at_fn(model, start, args.chunk): run(args.chunk)
    measured = shuffled_medians(jobs, args.rounds)
    chunks = {key[1]: measured.pop(key) for key in [k for k in measured if k[0] == "chunk"]}
    rows, lines = [], []
    for (ctx, r, k), s in sorted(measured.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
        blind = float(prof.step_s(r * k, n_requests=r))
        aware = float(prof.at_context(ctx).step_s(r * k, n_requests=r))
        rows.append({"context": ctx, "requests": r, "tokens_each": k, "measured_s": s, "grid_price_s": blind,
                     "context_price_s": aware})
        lines.append(f"| {r} | {k} | {ctx} | {1e3 * s:.1f} | {1e3 * blind:.1f} ({s / blind:.2f}) | "
                     f"{1e3 * aware:.1f} ({s / aware:.2f}) |")
    chunk_lines = []
    for start, sec in sorted(chunks.items()):
        table = float(prof.step_s(0, n_requests=0, prefill=(args.chunk,)))
        priced = float(prof.step_s(0, n_requests=0, prefill=((args.chunk, start),)))
        rows.append({"prompt_chunk": args.chunk, "start": start, "measured_s": sec, "prefill_table_s": table,
                     "with_later_chunk_price_s": priced})
        chunk_lines.append(f"| {args.chunk} | {start} | {1e3 * sec:.0f} | {1e3 * table:.0f} ({sec / table:.2f}) | "
                           f"{1e3 * priced:.0f} ({sec / priced:.2f}) |")
    md = (f"# A verify step against the context ({args.model}, {args.rounds} shuffled rounds, medians)\n\n"
          f"Profile: measured at {prof.grid_context} tokens of context; context prices "
          f"{prof.context_request_s * 1e6:.3f} µs per request and {prof.context_token_s * 1e6:.3f} µs per verified "
          f"token, per token of context.\n\n"
          "| R | k | context | measured ms | grid price ms (measured / price) | with context prices ms "
          "(measured / price) |\n|---|---|---|---|---|---|\n" + "\n".join(lines) + "\n\n"
          f"A prompt chunk alone after `start` tokens of its prompt (later-chunk price "
          f"{prof.prefill_context_s * 1e6:.3f} µs per chunk token per token before it):\n\n"
          "| chunk | start | measured ms | prefill table ms (measured / price) | with the later-chunk price ms "
          "(measured / price) |\n|---|---|---|---|---|\n" + "\n".join(chunk_lines) + "\n")
    print(md)
    if args.out:
        write_results(args.out, "context_cost", {"machine": machine_info(), "rounds": args.rounds,
                                                 "grid_context": prof.grid_context,
                                                 "context_request_s": prof.context_request_s,
                                                 "context_token_s": prof.context_token_s,
                                                 "prefill_context_s": prof.prefill_context_s, "steps": rows}, md)


if __name__ == "__main__":
    main()
