"""Closed-loop clients for `bench serve`: `concurrency` clients on one engine, each sending its next prompt as
soon as its request finishes.

Time is the engine's own: a loop's clock advances only while it steps its engine (the step plus replacing
finished requests). So several loops — one per policy — can be stepped in turn, and each still measures its own
throughput and per-user speed. Stepping them in turn is what makes policies comparable on a noisy machine: on
the 2-core dev VM a fixed forward switches between speed modes up to 20 % apart for seconds at a time
(`dspark bench serve --sequential` runs each cell alone, as before), and round-robin steps ~0.1 s apart put
every policy in the same modes in the same proportion. The order of each round is shuffled (seeded): in a fixed
order a loop always runs right after the same neighbour, and a step that follows a drafting policy's step is
slower (the drafter's working set evicted the target's): on the dev CPU the policy stepped after fixed-3 lost
~2 % at C = 4 to that alone (`scripts/engine_step_times.py --concurrency 4 --seconds 80 --policies
none,mtp1,fixed-3,async`, then the order `async,mtp1,fixed-3,none`: async / none 0.972 → 0.999).

Output lengths vary (`length_spread`): request i of every loop may produce up to round(L·u_i) tokens, u_i uniform
in [1 − s, 1 + s] from one fixed seed, so every policy serves the same (prompt, length) sequence. With one fixed
length the clients of plain decoding stay in lockstep forever — all finish in the same step, and the next wave's
prompts share one prefill forward — while any policy that accepts a draft now and then drifts out of step and
pays for several smaller prefills (on the dev CPU that alone cost async 4–5 % against none at C = 4). Real
traffic is not in lockstep.

A time budget (`run_loops(..., seconds)`) measures each loop's steady state, but a slower loop gets through fewer
requests than a faster one, so two policies are compared on different slices of a mix whose prompts differ in
length several-fold, and which prompts fall in a 12 s window is luck (async / none at C = 8 read 0.98, 0.82 and
0.98 in three repeats of one run, results/serving-s12-grid). With a request budget (`limit`: every loop sends the
same first `limit` requests, then lets its clients drain; `seconds=None`) every policy does the same work — at
T = 0 the same tokens — start-up wave and drain included, and the ratio of their throughputs is the ratio of
their times.
"""
from __future__ import annotations

import dataclasses
import itertools
import random
import time

import numpy as np

from ..decoding import SamplingParams
from ..engine.engine import Engine
from .common import median


class ClosedLoop:
    def __init__(self, engine: Engine, prompts: list[list[int]], concurrency: int, params: SamplingParams,
                 length_spread: float = 0.0, seed: int = 0, limit: int | None = None):
        if not 0 <= length_spread < 1:
            raise ValueError(f"length_spread must be in [0, 1), got {length_spread}")
        if limit is not None and limit < 1:
            raise ValueError(f"a request budget must be >= 1, got {limit}")
        self.limit, self.sent = limit, 0  # requests to send in all (None: no end), and sent so far
        self.engine, self.params, self.concurrency = engine, params, concurrency
        self.feed = itertools.cycle(prompts)  # every loop sends the same prompts in the same order
        self.spread, self.lengths = length_spread, np.random.default_rng(seed)  # ... with the same length limits
        self.clock = 0.0  # seconds this loop has spent stepping its engine
        self.arrival: dict[str, float] = {}  # request id -> clock at submission
        self.output_len: dict[str, int] = {}  # request id -> tokens it produced (set when it finishes), sent order
        self.cached: dict[str, int] = {}  # request id -> prompt tokens it copied from another request's cache
        self.done: list[tuple] = []  # (request, clock at finish) since `start_measuring`
        self.live = [self._submit() for _ in range(min(concurrency, limit or concurrency))]
        self.first_wave = {r.request_id for r in self.live}
        self.start_measuring()

    def _submit(self):
        params = self.params
        if self.spread:
            u = self.lengths.uniform(1 - self.spread, 1 + self.spread)
            params = dataclasses.replace(params, max_new_tokens=max(1, round(params.max_new_tokens * u)))
        if params.seed is not None:  # request i: seed + i, so a prompt sent again draws a fresh answer at T > 0
            params = dataclasses.replace(params, seed=params.seed + self.sent)
        req = self.engine.add_request(next(self.feed), params)
        self.sent += 1
        self.arrival[req.request_id] = self.clock
        self.output_len[req.request_id] = self.cached[req.request_id] = 0
        return req

    def tick(self) -> None:
        """One engine step; finished requests are replaced at once (their clients send the next prompt) until the
        request budget is spent."""
        t0 = time.perf_counter()
        self.engine.step()
        finished = [(i, req) for i, req in enumerate(self.live) if req.finished]
        for i, _ in reversed(finished):
            if self.limit is None or self.sent < self.limit:
                self.live[i] = self._submit()
            else:
                del self.live[i]
        self.clock += time.perf_counter() - t0
        self.done.extend((req, self.clock) for _, req in finished)
        self.output_len.update((req.request_id, len(req.output)) for _, req in finished)
        self.cached.update((req.request_id, req.cached_tokens) for _, req in finished)

    @property
    def first_wave_finished(self) -> bool:
        return not self.first_wave & {r.request_id for r in self.live}

    @property
    def measured_seconds(self) -> float:
        return self.clock - self.clock0

    def start_measuring(self) -> None:
        """Forget what came before: tokens already produced by running requests and the engine's counters."""
        self.done = []
        self.before = {r.request_id: len(r.output) for r in self.live}
        s = self.engine.stats
        self.clock0 = self.clock
        self.counters0 = (s.steps, s.verify_budget_total, s.decode_requests_total,
                          s.step_seconds_total, s.forward_seconds_total, s.drafter_seconds_total)

    def finish(self) -> dict:
        """The measurement so far; aborts the running requests, so the engine is empty for the next loop."""
        s, elapsed = self.engine.stats, self.measured_seconds
        done = [req for req, _ in self.done]
        produced = sum(len(r.output) - self.before.get(r.request_id, 0) for r in done + self.live)
        # Requests still running count too: at high concurrency a cell can end before any finishes.
        running = [r for r in self.live if r.rounds]
        per_user = ([len(r.output) / (t - self.arrival[r.request_id]) for r, t in self.done]
                    + [len(r.output) / (self.clock - self.arrival[r.request_id]) for r in running])
        seen = done + running
        steps0, budget0, decode0, step_s0, forward_s0, drafter_s0 = self.counters0
        decode_steps = s.decode_requests_total - decode0
        step_s = s.step_seconds_total - step_s0
        models_s = s.forward_seconds_total - forward_s0 + s.drafter_seconds_total - drafter_s0
        self.output_len.update((r.request_id, len(r.output)) for r in self.live)  # cut short by the cell's end
        self.cached.update((r.request_id, r.cached_tokens) for r in self.live)
        lengths, cached = list(self.output_len.values()), list(self.cached.values())
        for req in self.live:
            self.engine.abort(req.request_id)
        self.engine.step()  # reap the aborted requests
        return {"concurrency": self.concurrency, "finished_requests": len(done), "seconds": elapsed,
                "throughput_tok_s": produced / elapsed if elapsed else 0.0,
                "per_user_tok_s": median(per_user) if per_user else 0.0,
                "mean_verify_budget": (s.verify_budget_total - budget0) / decode_steps if decode_steps else 0,
                "tau": sum(r.accepted + r.rounds for r in seen) / max(1, sum(r.rounds for r in seen)),
                "steps": s.steps - steps0,
                # share of step time outside the target and drafter forwards: the engine's own overhead
                "overhead_fraction": max(0.0, 1 - models_s / step_s) if step_s else 0.0,
                "drafter_fraction": (s.drafter_seconds_total - drafter_s0) / step_s if step_s else 0.0,
                # every request sent, in order (the running ones cut short at the end): what the simulator replays
                "output_lengths": lengths, "cached_prompt_tokens": cached}


def run_loops(loops: list[ClosedLoop], seconds: float | None, warmup: float = 0.0, seed: int = 0) -> list[dict]:
    """Step the loops in turn, in a shuffled order each round, until each has measured `seconds` of its own time
    (None: until each has finished its request budget; no warm-up then).

    With `warmup` > 0 each loop first runs until every client's first request has finished (at most `warmup` of
    its own seconds) and only then measures: otherwise a cell at high concurrency measures the start-up wave (all
    prefills at once, no request finished) instead of the steady state."""
    order = random.Random(seed)

    def rotate(busy) -> None:
        while any(busy(loop) for loop in loops):
            for loop in order.sample(loops, len(loops)):
                if busy(loop):
                    loop.tick()

    if seconds is None:
        if any(loop.limit is None for loop in loops):
            raise ValueError("without a time budget every loop needs a request budget (limit)")
        rotate(lambda loop: bool(loop.live))
        return [loop.finish() for loop in loops]
    if warmup > 0:
        rotate(lambda loop: loop.clock < warmup and not loop.first_wave_finished)
        for loop in loops:
            loop.start_measuring()
    rotate(lambda loop: loop.measured_seconds < seconds)
    return [loop.finish() for loop in loops]


def run_cell(engine: Engine, prompts: list[list[int]], concurrency: int, params: SamplingParams,
             seconds: float | None, warmup: float = 0.0, length_spread: float = 0.0, limit: int | None = None) -> dict:
    """One policy alone: a single closed loop on `engine`."""
    return run_loops([ClosedLoop(engine, prompts, concurrency, params, length_spread, limit=limit)], seconds,
                     warmup)[0]
