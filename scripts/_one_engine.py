"""The set-up the async-scheduler diagnostics share: one engine with one policy on the `bench serve` prompt mix,
driven by closed-loop clients (scripts import it from their own directory)."""
from __future__ import annotations

import argparse

from dspark.bench.closed_loop import ClosedLoop
from dspark.bench.serving import ServeBenchConfig, setup


def engine_args(doc: str, concurrency: int, seconds: float) -> argparse.ArgumentParser:
    """A parser with the options every such script takes, at these defaults."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=concurrency)
    ap.add_argument("--seconds", type=float, default=seconds)
    ap.add_argument("--policy", default="async", help="an async policy spec, options allowed")
    ap.add_argument("--dtype", default="float32", help="the target's dtype (bench serve's --dtype)")
    ap.add_argument("--temperature", type=float, default=0.0, help="every request's temperature")
    return ap


def one_engine(args) -> tuple:
    """(engine, closed loop of ``args.concurrency`` clients) for ``args.policy``, as `bench serve` builds them."""
    cfg = ServeBenchConfig(drafter="dspark", dtype=args.dtype, policies=(args.policy,),
                           concurrency=(args.concurrency,), max_new_tokens=64, temperature=args.temperature)
    _, _, prompts, params, engines = setup(cfg)
    engine = engines[args.policy]
    return engine, ClosedLoop(engine, prompts, args.concurrency, params, 0.5)
