"""Workloads for the serving simulator: who arrives when, with how long a prompt, wanting how many tokens.

``ClosedLoop`` is C users each keeping one request in flight, either forever in steady state (the simulator's
sweeps) or, with ``requests_per_client``, the benchmark's cell: C clients starting cold together and replacing
each finished request until C × that many have been sent, the cell ending with the last one (the drain with fewer
than C running is part of what `dspark bench serve` measures). ``Poisson`` is an open loop. ``Requests`` is the
state a run carries: per running request, the tokens it still has to emit, the prompt tokens still to prefill and
the tokens of context it holds (what attention costs grow with). A prompt's tokens copied from another request's
cache (prompt-prefix reuse, `cached_mix`) are context but are not prefilled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import numpy as np


@dataclass(frozen=True)
class ClosedLoop:
    """C users, each with one request in flight; a finished request is replaced at once by a new one."""

    concurrency: int
    output_tokens: int = 256
    n_steps: int = 400  # steady state only (requests_per_client = 0)
    prompt_tokens: int = 0  # prefilled by each new request (in steady state the initial C start mid-decode)
    prompt_mix: tuple[int, ...] = ()  # prompt lengths new requests take in turn (instead of prompt_tokens)
    output_spread: float = 0.0  # a request's output length: round(output_tokens · u), u ~ U[1 − s, 1 + s]
    requests_per_client: int = 0  # > 0: C × this many requests in all from a cold start, then the drain
    output_mix: tuple[int, ...] = ()  # output lengths new requests take in turn (instead of output_tokens, spread)
    cached_mix: tuple[int, ...] = ()  # prompt tokens new requests copy instead of prefilling, in turn

    def __post_init__(self):
        if self.concurrency < 1 or self.output_tokens < 1 or self.requests_per_client < 0:
            raise ValueError(f"need concurrency >= 1, output_tokens >= 1 and requests_per_client >= 0, got "
                             f"{self.concurrency}, {self.output_tokens}, {self.requests_per_client}")
        if not 0.0 <= self.output_spread < 1.0:
            raise ValueError(f"output_spread must lie in [0, 1), got {self.output_spread}")


@dataclass(frozen=True)
class Poisson:
    """Open loop: ``n_requests`` requests arriving as a Poisson process of ``rate`` per second."""

    rate: float
    n_requests: int = 200
    output_tokens: int = 256
    prompt_tokens: int = 0
    prompt_mix: tuple[int, ...] = ()
    output_spread: float = 0.0
    output_mix: tuple[int, ...] = ()
    cached_mix: tuple[int, ...] = ()


Arrival = Union[ClosedLoop, Poisson]


class Requests:
    """The running requests of one simulated run, in arrival order: ``remaining`` [R] tokens to emit,
    ``prefill`` [R] prompt tokens still to prefill, ``context`` [R] prompt and output tokens so far (whole prompts,
    copied prefixes included: a decoding request's context is what it is priced at), ``cursor`` [R] where each
    one is in the recorded rounds when the simulator walks them (a random start, then one round a step). Lengths
    and starts come from their own seeded streams, so the simulator's round draws stay aligned across policies."""

    def __init__(self, arrival: Arrival, rng: np.random.Generator, seed: int = 0):
        self.arrival, self._lengths = arrival, np.random.default_rng([seed, 1])
        self._starts = np.random.default_rng([seed, 2])
        mix = np.asarray(arrival.prompt_mix or (arrival.prompt_tokens,), dtype=np.int64)
        if mix.ndim != 1 or (mix < 0).any():
            raise ValueError(f"prompt lengths must be integers >= 0, got {arrival.prompt_mix!r}")
        self._mix, self._next_prompt = mix, 0
        self._outputs = np.asarray(arrival.output_mix, dtype=np.int64)
        if self._outputs.ndim != 1 or (self._outputs < 1).any():
            raise ValueError(f"output lengths must be integers >= 1, got {arrival.output_mix!r}")
        self._cached = np.asarray(arrival.cached_mix, dtype=np.int64)
        if self._cached.ndim != 1 or (self._cached < 0).any():
            raise ValueError(f"copied prompt tokens must be integers >= 0, got {arrival.cached_mix!r}")
        self.closed = isinstance(arrival, ClosedLoop)
        # requests to send in all (0: no end, the steady state)
        self._budget = arrival.requests_per_client * arrival.concurrency if self.closed else 0
        if self.closed and not self._budget:
            # Steady state: staggered remaining lengths, else all C requests finish in lockstep waves.
            self.remaining = rng.integers(1, arrival.output_tokens + 1, size=arrival.concurrency)
            self.prefill = np.zeros(arrival.concurrency, dtype=np.int64)
            self.context = int(mix.mean()) + arrival.output_tokens - self.remaining  # mid-decode
        elif self.closed:  # the benchmark's cold start: every client sends its first request at once
            self.remaining, self.prefill, self.context = self._new(arrival.concurrency)
        else:
            self.remaining = self.prefill = self.context = np.empty(0, dtype=np.int64)
        self.cursor = self._start(self.remaining.size)
        self._sent = self.remaining.size
        self._arrivals = (np.cumsum(rng.exponential(1.0 / arrival.rate, size=arrival.n_requests))
                          if not self.closed else np.empty(0))
        self._joined = 0
        self.start = float(self._arrivals[0]) if self._arrivals.size else 0.0

    def _new(self, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(output lengths, prompt tokens to prefill, prompt lengths) of n new requests: the mixes in turn; a request
        prefills at least its last prompt token (its logits give the first output token), as the engine does."""
        out, spread = self.arrival.output_tokens, self.arrival.output_spread
        lengths = np.full(n, out, dtype=np.int64) if not spread else np.maximum(
            1, np.rint(out * self._lengths.uniform(1 - spread, 1 + spread, size=n))).astype(np.int64)
        turn = self._next_prompt + np.arange(n)  # the k-th request sent takes the k-th entries of the mixes
        if self._outputs.size:
            lengths = self._outputs[turn % self._outputs.size]
        prompts = self._mix[turn % self._mix.size]
        prefill = prompts if not self._cached.size else np.minimum(prompts, np.maximum(
            prompts - self._cached[turn % self._cached.size], 1))
        self._next_prompt += n
        return lengths, prefill, prompts

    def _start(self, n: int) -> np.ndarray:
        return self._starts.integers(0, 1 << 40, size=n)

    def admit(self, t: float, steps: int) -> float | None:
        """Before a step at time t: let arrivals up to t join (open loop); the time the step starts (later when
        idle until the next arrival), or None when the run is over."""
        if self.closed:
            return None if (self.remaining.size == 0 if self._budget else steps >= self.arrival.n_steps) else t
        n_new = int(np.searchsorted(self._arrivals, t, side="right")) - self._joined
        lengths, prefill, prompts = self._new(n_new)
        self.remaining = np.concatenate([self.remaining, lengths])
        self.prefill = np.concatenate([self.prefill, prefill])
        self.context = np.concatenate([self.context, prompts])
        self.cursor = np.concatenate([self.cursor, self._start(n_new)])
        self._joined += n_new
        if self.remaining.size:
            return t
        return None if self._joined >= self._arrivals.size else self.admit(float(self._arrivals[self._joined]),
                                                                             steps)

    def advance(self, took: np.ndarray, got: np.ndarray) -> int:
        """After a step: ``took`` [R] prompt tokens prefilled, ``got`` [R] tokens emitted; finished requests are
        replaced (closed loop, while their client has requests left) or leave. Returns how many finished."""
        self.prefill = self.prefill - took
        self.remaining = self.remaining - got
        self.context = self.context + got
        done = self.remaining == 0
        keep = ~done
        if self.closed:  # the first finished requests are replaced while the budget lasts
            n_again = int(done.sum()) if not self._budget else min(int(done.sum()), self._budget - self._sent)
            again = np.flatnonzero(done)[:n_again]
            self.remaining[again], self.prefill[again], self.context[again] = self._new(n_again)
            self.cursor[again] = self._start(n_again)
            self._sent += n_again
            keep[again] = True
        self.remaining, self.prefill, self.context = self.remaining[keep], self.prefill[keep], self.context[keep]
        self.cursor = self.cursor[keep]
        return int(done.sum())
