"""What a new request's prompt adds to the decoding step it rides in, and how the speed profile prices it.

    .venv/bin/python scripts/prefill_cost.py --out results/prefill-s25
    .venv/bin/python scripts/prefill_cost.py --prompts 64,256 --requests 0,8 --rounds 4

The engine fuses a new request's prompt (up to `prefill_chunk` tokens a step) into the forward of the requests
decoding beside it. This times, in shuffled rounds, one forward of a P-token prompt beside R requests decoding one
token each (warm 256-token contexts, as the profile's grid; R = 0: the prompt alone) and the same R requests
without it, and prints the prompt's extra time against R: whether "extra(P)" is one table or depends on the load.
With the cached profile of `--drafter` (measured if absent) it also prints what the profile prices the same steps
at: `step_s` with the prompt as one more request of P tokens (how the simulator priced prefill before profile
format 10) and with the profile's prefill table.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from dspark.bench.common import machine_info, shuffled_medians, write_results
from dspark.engine.profiling import _step_fn, _warm_caches, prefill_step_fn


def profile_prices(profile, prompt: int, n_requests: int) -> tuple[float, float]:
    """(as one more request of P tokens, with the prefill table) seconds for the step."""
    segments = n_requests + 1
    old = float(profile.step_s(n_requests + prompt, n_requests=segments)) if n_requests else float(
        profile.step_s(prompt, n_requests=1))
    new = float(profile.step_s(n_requests, n_requests=n_requests, prefill=(prompt,))) if hasattr(
        profile, "prefill_tokens") and profile.prefill_tokens else float("nan")
    return old, new


def load_profile(model_name: str, drafter_name: str):
    from dspark.drafters import make_drafter
    from dspark.engine.profiling import load_or_profile, profile_key
    from dspark.models import load_model

    loaded = load_model(model_name)
    drafter = make_drafter(drafter_name, target=loaded.model)
    key = profile_key(model_name, "float32", drafter.profile_id, loaded.model)
    return loaded.model, load_or_profile(loaded.model, key, drafter=drafter, prefill=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--drafter", default="dspark", help="whose cached profile to compare with")
    ap.add_argument("--prompts", default="16,32,64,128,256,512", help="prompt chunk sizes P")
    ap.add_argument("--requests", default="0,1,4,8,16,32", help="decoding requests R beside the prompt")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--out", default=None, help="directory for prefill.json and prefill.md")
    args = ap.parse_args()
    model, profile = load_profile(args.model, args.drafter)
    prompts = [int(x) for x in args.prompts.split(",")]
    requests = [int(x) for x in args.requests.split(",")]
    caches = _warm_caches(model)
    step, prefill = _step_fn(model, caches), prefill_step_fn(model, caches)
    jobs = {("decode", r): (lambda r=r: step([1] * r)) for r in requests if r}
    jobs.update({(p, r): (lambda p=p, r=r: prefill(p, r)) for p in prompts for r in requests})
    t = shuffled_medians(jobs, args.rounds)
    rows = []
    for p in prompts:
        for r in requests:
            base = t[("decode", r)] if r else 0.0
            old, new = profile_prices(profile, p, r)
            rows.append({"prompt": p, "requests": r, "step_ms": round(t[(p, r)] * 1e3, 2),
                         "decode_ms": round(base * 1e3, 2), "extra_ms": round((t[(p, r)] - base) * 1e3, 2),
                         "priced_as_request_ms": round(old * 1e3, 2), "priced_prefill_table_ms": round(new * 1e3, 2)})
    table = ("| prompt P | decoding R | step ms | without the prompt ms | extra ms | priced as a request ms (/ "
             "measured) | priced by prefill table ms (/ measured) |\n|---|---|---|---|---|---|---|\n")
    for x in rows:
        old, new = x["priced_as_request_ms"], x["priced_prefill_table_ms"]
        table += (f"| {x['prompt']} | {x['requests']} | {x['step_ms']:.1f} | {x['decode_ms']:.1f} | {x['extra_ms']:.1f} "
                  f"| {old:.1f} ({old / x['step_ms']:.2f}) | {new:.1f} ({new / x['step_ms']:.2f}) |\n")
    meta = {"model": args.model, "profile": profile.source, "profile_key": profile.key.as_dict() if profile.key
            else None, "rounds": args.rounds, **machine_info()}
    print(f"medians of {args.rounds} shuffled rounds: {json.dumps(meta)}\n\n{table}")
    if args.out:
        write_results(Path(args.out), "prefill", {"settings": meta, "results": rows},
                      f"# A prompt's cost in the step it rides in ({time.strftime('%Y-%m-%d %H:%M')})\n\n"
                      f"{json.dumps(meta)}\n\n{table}")


if __name__ == "__main__":
    main()
