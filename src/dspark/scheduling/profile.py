"""Hardware speed profile SPS(B): forward steps per second of the target against the tokens verified per step.

The prefix scheduler (policies.py) needs to know what one more verified token costs *on this machine at this
load*: on a GPU a verify step is nearly free up to some batch size and linear after it; on the CPUs this project
develops on it is ~flat to ~16 tokens (see DESIGN.md §3). We therefore measure a small table once, cache it on
disk keyed by everything that changes it (model, drafter, machine, dtype), and interpolate.

Conventions
  * B = tokens in the verify forward = R anchors + sum of verification lengths (so plain decoding is B = R).
  * ``seconds[i]`` is the wall time of one verify step over ``tokens[i]`` tokens.
  * The optional drafting cost is a second table: seconds of one drafting step for R running requests.
  * Between table points: piecewise-linear in *time* (time, not speed, is what grows linearly with work).
    Below the first point: flat (a step never gets cheaper than the smallest one measured).
    Above the last point: linear with the last segment's slope (clamped at >= 0), or flat if asked.
  * A step's cost depends on how many requests share it, not only on B: each request is its own attention
    segment, with per-op costs of its own (~1.7-2.6 ms per request per step for SmolLM2 on the dev CPU, as much as
    two extra tokens). The table is measured with ``tokens_per_segment`` tokens per request, so when a caller
    knows R: step(B, R) = table(B) + segment_seconds · (R − segments(B)), segments(B) = max(1, B // tps). Without
    it the scheduler at R = 1 overprices an 8-token block by ~20 % and at R = 16 overprices each verified token
    by ~50 % (the table's slope mixes the price of tokens with that of more requests).
  * Better still, a *grid* measures the steps the scheduler actually compares: R requests verifying k tokens
    each (k = 1 is plain decoding). With it step(B, R) interpolates the grid at (R, k = B / R) — linear in R,
    then in k, linear above both (slopes clamped at >= 0). The per-request model above priced R one-token requests
    18-21 % too high on the dev CPU at R = 4 and 16 (the native attention kernel makes a one-token request nearly
    free), i.e. it made plain decoding look dearer than it is and speculation cheaper.
"""

from __future__ import annotations

import functools
import platform
import random
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import numpy as np


@dataclass(frozen=True)
class ProfileKey:
    """Everything that makes a cached profile invalid when it changes."""

    model_id: str
    drafter_id: str
    machine: str
    dtype: str
    kernels: str = "torch"  # native kernels used: "native" (projections), "attention"; files without it: torch

    def as_dict(self) -> dict[str, str]:
        return {"model_id": self.model_id, "drafter_id": self.drafter_id, "machine": self.machine, "dtype": self.dtype,
                "kernels": self.kernels}


def cpu_name() -> str:
    """The CPU model ("unknown-cpu" if it cannot be read)."""
    cpu = platform.processor() or ""
    try:  # /proc/cpuinfo names the CPU on Linux, where platform.processor() often says only "x86_64".
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return cpu or "unknown-cpu"


def current_machine() -> str:
    """platform + CPU model + torch threads (+ GPU name): the things that change step times by large factors."""
    parts = [platform.platform(), cpu_name()]
    try:
        import torch  # lazy: keeps this module importable (and fast to import) without torch.

        parts.append(f"torch-threads={torch.get_num_threads()}")
        if torch.cuda.is_available():
            parts.append(f"cuda={torch.cuda.get_device_name(0)}")
    except ImportError:
        parts.append("torch-threads=?")
    return " | ".join(parts)


def _check_table(xs: Sequence[float], ys: Sequence[float], what: str) -> None:
    if len(xs) != len(ys) or len(xs) == 0:
        raise ValueError(f"{what}: need the same non-zero number of sizes and seconds, got {len(xs)} and {len(ys)}")
    if any(int(x) != x or x < 1 for x in xs):
        raise ValueError(f"{what}: sizes must be integers >= 1, got {list(xs)}")
    if any(b <= a for a, b in zip(xs, xs[1:])):
        raise ValueError(f"{what}: sizes must be strictly increasing, got {list(xs)}")
    if any(not (np.isfinite(y) and y > 0) for y in ys):
        raise ValueError(f"{what}: seconds must be finite and > 0, got {list(ys)}")


def _interp(x, xs: np.ndarray, ys: np.ndarray, linear_above: bool):
    """np.interp (flat outside) plus optional linear extrapolation above the last point; scalar in -> float out."""
    xa = np.asarray(x, dtype=np.float64)
    y = np.interp(xa, xs, ys)
    if linear_above and len(xs) >= 2:
        # Clamp the slope: a noisy table whose last segment dips must not extrapolate to negative times.
        slope = max(0.0, (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]))
        y = np.where(xa > xs[-1], ys[-1] + slope * (xa - xs[-1]), y)
    return float(y) if y.ndim == 0 else y


def _samples_per_round(fn: Callable[[int], object], n: int, warmup: int, min_seconds: float, cap: int,
                       timer: Callable[[], float]) -> int:
    """Run ``fn(n)`` ``warmup`` times (at least twice when sampling by time); how many samples of it fit in
    ``min_seconds`` (1..cap), judged by the fastest warm-up call: the first call of a job is often its slowest
    (one 30 ms step's took 50 ms and left it a single sample per round)."""
    calls = max(warmup, 2) if min_seconds > 0 else warmup
    fastest = float("inf")
    for _ in range(calls):
        t0 = timer()
        fn(n)
        fastest = min(fastest, timer() - t0)
    if min_seconds <= 0:
        return 1
    return int(min(cap, max(1, min_seconds // max(fastest, 1e-9))))


@dataclass(frozen=True)
class SpeedProfile:
    tokens: tuple[int, ...]  # [P] verified-token counts B, strictly increasing
    seconds: tuple[float, ...]  # [P] seconds per verify step at tokens[i]
    draft_requests: tuple[int, ...] = ()  # [D] running-request counts R (empty: drafting cost ignored)
    draft_seconds: tuple[float, ...] = ()  # [D] seconds per drafting step at draft_requests[i]
    extrapolate: str = "linear"  # above the last point: "linear" or "flat"
    key: ProfileKey | None = None
    source: str = ""  # free text: "measured", "user table <path>", "synthetic ..."
    segment_seconds: float = 0.0  # extra seconds per request at a fixed B (0: requests cost nothing extra)
    tokens_per_segment: int = 0  # how the table split B into requests when measured (0: no request model)
    # Drafting only as deep as the verification can use: seconds per drafting step at depth 1 for each
    # draft_requests[i], the full table being measured at depth ``draft_depth`` (γ); empty: depth not priced.
    shallow_draft_seconds: tuple[float, ...] = ()
    draft_depth: int = 0
    # Measured grid: grid_seconds[i][j] = one step of grid_requests[i] requests verifying grid_tokens[j] tokens each.
    grid_requests: tuple[int, ...] = ()  # [Gr]
    grid_tokens: tuple[int, ...] = ()  # [Gk]
    grid_seconds: tuple[tuple[float, ...], ...] = ()  # [Gr][Gk]
    # Measured prompt cost: prefill_seconds[i][j] = one step carrying a fresh prefill_tokens[j]-token prompt chunk
    # beside prefill_requests[i] requests decoding one token each (0: the prompt alone).
    prefill_requests: tuple[int, ...] = ()  # [Pr]
    prefill_tokens: tuple[int, ...] = ()  # [Pp]
    prefill_seconds: tuple[tuple[float, ...], ...] = ()  # [Pr][Pp]
    # Cached numpy views, so sps() on a hot path does not rebuild arrays each call.
    _t: np.ndarray = field(init=False, repr=False, compare=False)
    _s: np.ndarray = field(init=False, repr=False, compare=False)
    _grid: tuple = field(init=False, repr=False, compare=False)  # (requests [Gr], tokens [Gk], seconds [Gr, Gk])

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", tuple(int(t) for t in self.tokens))
        object.__setattr__(self, "seconds", tuple(float(s) for s in self.seconds))
        object.__setattr__(self, "draft_requests", tuple(int(t) for t in self.draft_requests))
        object.__setattr__(self, "draft_seconds", tuple(float(s) for s in self.draft_seconds))
        object.__setattr__(self, "shallow_draft_seconds", tuple(float(s) for s in self.shallow_draft_seconds))
        if self.shallow_draft_seconds:
            _check_table(self.draft_requests, self.shallow_draft_seconds, "depth-1 drafting cost table")
            if len(self.shallow_draft_seconds) != len(self.draft_seconds) or self.draft_depth < 2:
                raise ValueError("shallow_draft_seconds needs one value per draft_requests entry and a "
                                 f"draft_depth >= 2 (the full table's depth), got draft_depth {self.draft_depth}")
        _check_table(self.tokens, self.seconds, "speed profile")
        if self.draft_requests or self.draft_seconds:
            _check_table(self.draft_requests, self.draft_seconds, "drafting cost table")
        if self.extrapolate not in ("linear", "flat"):
            raise ValueError(f"extrapolate must be 'linear' or 'flat', got {self.extrapolate!r}")
        if not (np.isfinite(self.segment_seconds) and self.segment_seconds >= 0) or self.tokens_per_segment < 0:
            raise ValueError(f"segment_seconds must be finite and >= 0 and tokens_per_segment >= 0, got "
                             f"{self.segment_seconds!r}, {self.tokens_per_segment!r}")
        self._check_grid()
        self._check_prefill()
        object.__setattr__(self, "_t", np.asarray(self.tokens, dtype=np.float64))
        object.__setattr__(self, "_s", np.asarray(self.seconds, dtype=np.float64))

    def _check_grid(self) -> None:
        grid = tuple(tuple(float(x) for x in row) for row in self.grid_seconds)
        object.__setattr__(self, "grid_seconds", grid)
        object.__setattr__(self, "grid_requests", tuple(int(r) for r in self.grid_requests))
        object.__setattr__(self, "grid_tokens", tuple(int(k) for k in self.grid_tokens))
        object.__setattr__(self, "_grid", tuple(np.asarray(x, dtype=np.float64)
                                                for x in (self.grid_requests, self.grid_tokens, grid)))
        if not (self.grid_requests or self.grid_tokens or grid):
            return
        _check_table(self.grid_requests, [1.0] * len(self.grid_requests), "grid requests")
        _check_table(self.grid_tokens, [1.0] * len(self.grid_tokens), "grid tokens per request")
        if len(grid) != len(self.grid_requests) or any(len(row) != len(self.grid_tokens) for row in grid):
            raise ValueError(f"grid_seconds must be {len(self.grid_requests)} rows of {len(self.grid_tokens)} values")
        for row in grid:
            _check_table(self.grid_tokens, row, "grid seconds")

    def _check_prefill(self) -> None:
        table = tuple(tuple(float(x) for x in row) for row in self.prefill_seconds)
        object.__setattr__(self, "prefill_seconds", table)
        object.__setattr__(self, "prefill_requests", tuple(int(r) for r in self.prefill_requests))
        object.__setattr__(self, "prefill_tokens", tuple(int(p) for p in self.prefill_tokens))
        if not (self.prefill_requests or self.prefill_tokens or table):
            return
        _check_table([r + 1 for r in self.prefill_requests], [1.0] * len(self.prefill_requests),
                     "prefill requests (>= 0)")
        _check_table(self.prefill_tokens, [1.0] * len(self.prefill_tokens), "prefill prompt tokens")
        if len(table) != len(self.prefill_requests) or any(len(row) != len(self.prefill_tokens) for row in table):
            raise ValueError(f"prefill_seconds must be {len(self.prefill_requests)} rows of "
                             f"{len(self.prefill_tokens)} values")
        for row in table:
            _check_table(self.prefill_tokens, row, "prefill seconds")

    def prefill_extra_s(self, prompt: int, n_requests: int) -> float:
        """Seconds a ``prompt``-token chunk adds to a step of ``n_requests`` decoding requests (0: the chunk alone),
        from the prefill table: linear in the prompt (time grows with the work), linear in the load between the
        loads measured and flat beyond them."""
        ps = np.asarray(self.prefill_tokens, dtype=np.float64)
        extras = []
        for r, row in zip(self.prefill_requests, self.prefill_seconds):
            base = float(self.step_s(r, n_requests=r)) if r else 0.0
            extras.append(_interp(prompt, ps, np.asarray(row) - base, self.extrapolate == "linear"))
        return float(max(0.0, np.interp(n_requests, self.prefill_requests, extras)))

    def _grid_step_s(self, n_tokens, n_requests):
        rs, ks, s = self._grid  # [Gr], [Gk], [Gr, Gk]
        r = np.maximum(np.asarray(n_requests, dtype=np.float64), 1.0)
        r, k = np.broadcast_arrays(r, np.maximum(np.asarray(n_tokens, dtype=np.float64) / r, 1.0))
        by_k = np.stack([np.asarray(_interp(r, rs, s[:, j], True)) for j in range(ks.size)], axis=-1)  # [..., Gk]
        if ks.size == 1:
            t = by_k[..., 0]
        else:
            hi = np.clip(np.searchsorted(ks, k, side="right"), 1, ks.size - 1)  # upper bracket of k
            y0 = np.take_along_axis(by_k, (hi - 1)[..., None], -1)[..., 0]
            y1 = np.take_along_axis(by_k, hi[..., None], -1)[..., 0]
            w = (k - ks[hi - 1]) / (ks[hi] - ks[hi - 1])
            t = np.where(w > 1, y1 + (w - 1) * np.maximum(y1 - y0, 0.0), y0 + w * (y1 - y0))
        t = np.maximum(t, s.min())  # never cheaper than the cheapest step measured
        return float(t) if np.ndim(t) == 0 else t

    def step_s(self, n_tokens, n_requests=None, prefill: Sequence[int] = ()):
        """Seconds of one verify step over B tokens (scalar or array [n]), shared by ``n_requests`` requests when
        given (else by as many as the table was measured with); from the grid when there is one. ``prefill``: the
        prompt chunks of new requests riding in the same step (scalar B and R only), priced by the prefill table
        when there is one, else as one more request of that many tokens each (on the dev CPU that priced a
        128-token prompt beside 8 decoding requests 1.38x its cost: scripts/prefill_cost.py)."""
        if len(prefill):
            if not self.prefill_seconds:
                return self.step_s(n_tokens + sum(prefill), n_requests=(n_requests or 0) + len(prefill))
            decoding = int(n_requests if n_requests is not None else 0)
            base = float(self.step_s(n_tokens, n_requests)) if decoding else 0.0
            return base + sum(self.prefill_extra_s(p, decoding) for p in prefill)
        if n_requests is not None and self.grid_seconds:
            return self._grid_step_s(n_tokens, n_requests)
        t = _interp(n_tokens, self._t, self._s, self.extrapolate == "linear")
        if n_requests is None or not self.segment_seconds or not self.tokens_per_segment:
            return t
        measured_with = np.maximum(1, np.asarray(n_tokens) // self.tokens_per_segment)
        # Never cheaper than the smallest step measured: a wildly small R must not price a step at ~0 s.
        t = np.maximum(t + self.segment_seconds * (np.asarray(n_requests) - measured_with), self._s[0])
        return float(t) if np.ndim(t) == 0 else t

    def draft_s(self, n_requests, depth=None):
        """Seconds of one drafting step for R requests (0 when no drafting table was given), drafting ``depth``
        slots (scalar or array; None: the full block). Cost is linear in depth between the depth-1 and the
        full-depth tables (the Markov and confidence heads run once per slot; near-linear on the dev CPU: 3.2 / 3.7
        / 4.1 / 4.2 / 5.4 ms at depth 1 / 2 / 3 / 4 / 7 for one request, scripts/propose_cost.py)."""
        if not self.draft_requests:
            shape = np.broadcast(np.asarray(n_requests), np.asarray(depth if depth is not None else 0)).shape
            return 0.0 if not shape else np.zeros(shape)
        xs = np.asarray(self.draft_requests, dtype=np.float64)
        full = _interp(n_requests, xs, np.asarray(self.draft_seconds, dtype=np.float64), self.extrapolate == "linear")
        if depth is None or not self.shallow_draft_seconds:
            return full
        one = _interp(n_requests, xs, np.asarray(self.shallow_draft_seconds, dtype=np.float64),
                      self.extrapolate == "linear")
        frac = np.clip((np.asarray(depth, dtype=np.float64) - 1) / (self.draft_depth - 1), 0.0, 1.0)
        t = one + (full - one) * frac
        return float(t) if np.ndim(t) == 0 else t

    def sps(self, n_tokens, n_requests: int | None = None, depth=None):
        """Steps per second at B tokens; with ``n_requests`` the drafting cost of that many requests (drafting
        ``depth`` slots, default the full block) is added."""
        t = self.step_s(n_tokens, n_requests)
        if n_requests is not None:
            t = t + self.draft_s(n_requests, depth)
        return 1.0 / t

    __call__ = sps  # a SpeedProfile can be passed wherever an SPS callable is expected


def measure_profile(
    step_fn: Callable[[int], object],
    token_counts: Iterable[int],
    repeats: int = 5,
    *,
    warmup: int = 1,
    draft_fn: Callable[[int], object] | None = None,
    shallow_draft_fn: Callable[[int], object] | None = None,
    draft_depth: int = 0,
    request_counts: Iterable[int] = (),
    one_segment_fn: Callable[[int], object] | None = None,
    tokens_per_segment: int = 0,
    grid_fn: Callable[[int, int], object] | None = None,
    grid_requests: Iterable[int] = (),
    grid_tokens: Iterable[int] = (),
    prefill_fn: Callable[[int, int], object] | None = None,
    prefill_requests: Iterable[int] = (),
    prefill_tokens: Iterable[int] = (),
    key: ProfileKey | None = None,
    timer: Callable[[], float] = time.perf_counter,
    min_job_seconds: float = 0.0,
    max_samples_per_round: int = 4,
    shuffle_seed: int | None = None,
    table_cell: Callable[[int], tuple[int, int] | None] | None = None,
) -> SpeedProfile:
    """Time ``step_fn(B)`` for each B (median of ``repeats`` after ``warmup`` untimed calls).

    ``step_fn`` must run one complete verify step over B tokens *and wait for it* (on a GPU: synchronise), since
    we time the call from outside. The median, not the mean, because one page fault or GC pause must not make a
    table point look twice as slow. The repeats are interleaved — round r times every B once — because a
    shared machine changes speed for seconds at a time (up to 1.44x between blocks on the dev VM): timed back to
    back, a slow phase lands on some points and not others and bends the curve the scheduler trusts.

    With ``one_segment_fn`` (the same B tokens as one request) and the ``tokens_per_segment`` split ``step_fn``
    uses, the largest B is timed both ways too, giving ``segment_seconds``: what one more request costs.
    With ``shallow_draft_fn`` (one drafting step at depth 1) and the full depth ``draft_depth`` of ``draft_fn``,
    drafting is timed at both depths (in the same rounds as the target's steps), so the scheduler can price
    shallow drafting.
    With ``grid_fn(R, k)`` (R requests verifying k tokens each) every ``grid_requests`` × ``grid_tokens`` pair is
    timed too, interleaved with the table, giving the grid ``step_s`` prefers.
    With ``min_job_seconds`` a job cheaper than that is timed up to ``max_samples_per_round`` times per round
    (as many as fit, judged by its warm-up calls), in sub-rounds over all such jobs: the cheap one-request
    steps are the ones whose ratios decide whether drafting pays at low load, and 9 samples of a 30 ms step left
    the same step priced 36 and 44 ms in two cells of one profile, and a 2-token step 1.23x a 1-token one where
    the engine ran it at ~1.12x (scripts/step_order_cost.py).
    With ``shuffle_seed`` each (sub-)round visits its jobs in a fresh seeded random order: a step's time may
    depend on the step before it (0.99-1.17x after a 32 x 8-token step, scripts/step_order_cost.py), and in a
    fixed order each job always follows the same neighbour, a bias no number of repeats would remove.
    With ``prefill_fn(R, P)`` (a P-token prompt chunk beside R requests decoding one token each) every
    ``prefill_requests`` × ``prefill_tokens`` pair is timed too, giving the prefill table ``step_s`` prices new
    requests' prompts by.
    ``table_cell(B)`` names the grid cell (R, k) that runs the same step as ``step_fn(B)``, if any; such table
    points are read from the grid instead of being timed twice.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if not (min_job_seconds >= 0) or max_samples_per_round < 1:
        raise ValueError(f"min_job_seconds must be >= 0 and max_samples_per_round >= 1, got {min_job_seconds!r}, "
                         f"{max_samples_per_round!r}")

    def median_times(jobs: list[tuple[Callable[[int], object], int]]) -> list[float]:
        reps = [_samples_per_round(fn, n, warmup, min_job_seconds, max_samples_per_round, timer) for fn, n in jobs]
        times: list[list[float]] = [[] for _ in jobs]
        rng = random.Random(shuffle_seed)
        for _ in range(repeats):
            for sub in range(max(reps)):  # sub-rounds keep a cheap job's extra samples spread over the round
                visit = [j for j, k in enumerate(reps) if sub < k]
                if shuffle_seed is not None:
                    rng.shuffle(visit)
                for j in visit:
                    fn, n = jobs[j]
                    t0 = timer()
                    fn(n)
                    times[j].append(timer() - t0)
        return [float(np.median(ts)) for ts in times]

    tokens = sorted({int(b) for b in token_counts})
    segments = max(1, tokens[-1] // tokens_per_segment) if tokens_per_segment else 1
    split_both = one_segment_fn is not None and segments > 1
    g_req = sorted({int(r) for r in grid_requests}) if grid_fn is not None else []
    g_tok = sorted({int(k) for k in grid_tokens}) if g_req else []
    grid_jobs = [(functools.partial(grid_fn, r), k) for r in g_req for k in g_tok]
    p_req = sorted({int(r) for r in prefill_requests}) if prefill_fn is not None else []
    p_tok = sorted({int(p) for p in prefill_tokens}) if p_req else []
    prefill_jobs = [(functools.partial(prefill_fn, r), p) for r in p_req for p in p_tok]
    reqs: list[int] = sorted({int(r) for r in request_counts}) if draft_fn is not None else []
    shallow = shallow_draft_fn is not None and draft_fn is not None and draft_depth >= 2
    draft_jobs = [(draft_fn, r) for r in reqs] + ([(shallow_draft_fn, r) for r in reqs] if shallow else [])
    # Drafting is timed in the same rounds as the target's steps: the scheduler weighs one against the other, so
    # a slow phase must not land on one block of them only; and each proposal then follows a target forward, as
    # in the engine, where the target has just pushed the drafter's weights out of the caches.
    # A table point that is the same step as a grid cell (one request of B tokens is cell (1, B)) takes that
    # cell's samples rather than being timed again: half the table duplicated the grid, in twice the time.
    cells = {rk: i for i, rk in enumerate((r, k) for r in g_req for k in g_tok)}
    same = {b: cells.get(table_cell(b)) for b in tokens} if table_cell is not None else {}
    own = [b for b in tokens if same.get(b) is None]
    t = median_times([(step_fn, b) for b in own] + ([(one_segment_fn, tokens[-1])] if split_both else [])
                     + grid_jobs + prefill_jobs + draft_jobs)
    own_s, t = dict(zip(own, t[:len(own)])), t[len(own):]
    one_request, t = (t[0] if split_both else 0.0), t[int(split_both):]
    grid_flat, t = t[:len(grid_jobs)], t[len(grid_jobs):]
    prefill_flat, t = t[:len(prefill_jobs)], t[len(prefill_jobs):]
    dsec, shallow_sec = t[:len(reqs)], t[len(reqs):]
    seconds = [own_s[b] if same.get(b) is None else grid_flat[same[b]] for b in tokens]
    grid = tuple(tuple(grid_flat[i * len(g_tok):(i + 1) * len(g_tok)]) for i in range(len(g_req)))
    seg_s = max(0.0, (seconds[-1] - one_request) / (segments - 1)) if split_both else 0.0
    return SpeedProfile(tuple(tokens), tuple(seconds), tuple(reqs), tuple(dsec), key=key, source="measured",
                        segment_seconds=seg_s, tokens_per_segment=tokens_per_segment if split_both else 0,
                        shallow_draft_seconds=tuple(shallow_sec), draft_depth=draft_depth if shallow else 0,
                        grid_requests=tuple(g_req), grid_tokens=tuple(g_tok), grid_seconds=grid,
                        prefill_requests=tuple(p_req), prefill_tokens=tuple(p_tok),
                        prefill_seconds=tuple(tuple(prefill_flat[i * len(p_tok):(i + 1) * len(p_tok)])
                                              for i in range(len(p_req))))
