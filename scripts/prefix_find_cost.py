"""What does looking up a prompt prefix cost per admitted request? PrefixCache.find (engine/prefix_cache.py)
against the reference it replaced in session 30 — the common prefix taken by copying both token lists into numpy
arrays, every donor scanned — for a request arriving at running donors (scanned) or at finished ones kept as
donors (indexed by block keys since session 37).

    .venv/bin/python scripts/prefix_find_cost.py [--donors 16,64,512] [--prompt 1000] [--repeats 5]
        [--where running,kept] [--out DIR]

Cases: `shared system prompt` (every donor holds the same `--prompt`-token system prompt, then its own 20-token
user turn: no donor holds the whole prompt, so every donor is compared), `same prompt` (n choices of one prompt, a
burst of one prompt: the first ready donor holds it whole) and `distinct` (no donor shares the first 16 tokens).
Prints the mean time per lookup (median over repeats), checks both pick a donor sharing as much, and writes
prefix_find.json + prefix_find.md.
"""
from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from dspark.decoding import SamplingParams
from dspark.engine.prefix_cache import PrefixCache
from dspark.engine.request import Request, Status


def numpy_common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if len(diff) else n


def reference_find(cache: PrefixCache, req, running, coverage):
    """The session-29 lookup: every donor scanned, numpy common prefix."""
    wanted = req.prompt[: len(req.prompt) - 1]
    head, best = wanted[: cache.min_tokens], None
    for donor in itertools.chain(running, cache.kept.values()):
        if donor is req or donor.cache is None or donor.prefix_state != "done":
            continue
        tokens = donor.prompt if len(donor.prompt) >= len(wanted) else donor.prompt + donor.output
        if tokens[: cache.min_tokens] != head:
            continue
        shared = numpy_common_prefix(wanted, tokens)
        ready = min(shared, donor.cache.length, donor.num_tokens, coverage(donor))
        waits = ready < shared and donor.status is Status.PREFILL
        key = (shared if waits else ready, not waits)
        if key[0] >= cache.min_tokens and (best is None or key > best[0]):
            best = (key, key[0])
    return None if best is None else best[1]


def donor(prompt: list[int]) -> Request:
    r = Request(list(prompt), SamplingParams(max_new_tokens=64))
    r.output = [7] * 32
    r.cache, r.prefix_state, r.status = SimpleNamespace(length=len(prompt) + 32), "done", Status.DECODE
    return r


def kept_cache(donors: list[Request]) -> PrefixCache:
    """A cache holding `donors` as finished, kept donors (the engine's keep(), entry limit above their count)."""
    cache = PrefixCache(min_tokens=16, max_entries=len(donors))
    for d in donors:
        d.status = Status.FINISHED
        cache.keep(d)
    return cache


def make_case(name: str, donors: int, length: int, rng: random.Random):
    system = [rng.randrange(49152) for _ in range(length)]
    turn = lambda: [rng.randrange(49152) for _ in range(20)]  # noqa: E731
    if name == "shared system prompt":
        running, prompt = [donor(system + turn()) for _ in range(donors)], system + turn()
    elif name == "same prompt":
        prompt = system + turn()
        running = [donor(prompt) for _ in range(donors)]
    else:
        running = [donor([rng.randrange(49152) for _ in range(length + 20)]) for _ in range(donors)]
        prompt = system + turn()
    return Request(prompt, SamplingParams(max_new_tokens=64)), running


def time_lookups(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--donors", default="16,64,512")
    ap.add_argument("--prompt", type=int, default=1000, help="system prompt tokens")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--where", default="running,kept", help="donors running (scanned) or kept (indexed)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    rng, rows = random.Random(0), []
    coverage = lambda d: d.num_tokens  # noqa: E731  (a target without a model drafter)
    for where, name, n in itertools.product(args.where.split(","), ("shared system prompt", "same prompt", "distinct"),
                                            [int(x) for x in args.donors.split(",")]):
        req, running = make_case(name, n, args.prompt, rng)
        cache = PrefixCache(min_tokens=16)
        if where == "kept":
            cache, running = kept_cache(running), []
        match = cache.find(req, running, coverage)
        assert (None if match is None else match.length) == reference_find(cache, req, running, coverage)
        calls = max(3, 2000 // n)
        ours = statistics.median(time_lookups(lambda: cache.find(req, running, coverage), calls)
                                 for _ in range(args.repeats))
        ref = statistics.median(time_lookups(lambda: reference_find(cache, req, running, coverage), calls)
                                for _ in range(args.repeats))
        rows.append({"donors_are": where, "case": name, "donors": n, "prompt_tokens": len(req.prompt),
                     "shared": None if match is None else match.length,
                     "find_us": round(ours * 1e6, 1), "reference_us": round(ref * 1e6, 1),
                     "speedup": round(ref / ours, 1)})
        print(rows[-1], flush=True)
    table = ["| donors are | case | donors | prompt tokens | shared | find µs | reference µs | reference / find |",
             "|---|---|---|---|---|---|---|---|"]
    table += [f"| {r['donors_are']} | {r['case']} | {r['donors']} | {r['prompt_tokens']} | {r['shared']} | "
              f"{r['find_us']} | {r['reference_us']} | {r['speedup']} |" for r in rows]
    print("\n".join(table))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "prefix_find.json").write_text(json.dumps({"settings": vars(args) | {"out": str(args.out)},
                                                              "rows": rows}, indent=1))
        (args.out / "prefix_find.md").write_text(f"# Prefix lookup per admitted request (`scripts/prefix_find_cost."
                                                 f"py --donors {args.donors} --prompt {args.prompt} --repeats "
                                                 f"{args.repeats} --where {args.where}`)\n\n" + "\n".join(table) + "\n")


if __name__ == "__main__":
    main()
