"""Timing a speed profile: ``measure_profile`` runs the step functions it is given, interleaved and shuffled, and
returns the ``SpeedProfile`` record (profile.py) the scheduler prices steps by. engine/profiling.py supplies the
step functions for a real target."""

from __future__ import annotations

import functools
import random
import time
from typing import Callable, Iterable

import numpy as np

from .profile import ProfileKey, SpeedProfile


def _samples_per_round(fn: Callable[[int], object], n: int, warmup: int, min_seconds: float, cap: int,
                       timer: Callable[[], float]) -> tuple[int, float]:
    """Run ``fn(n)`` ``warmup`` times (at least twice when sampling by time); how many samples of it fit in
    ``min_seconds`` (1..cap), judged by the fastest warm-up call: the first call of a job is often its slowest
    (one 30 ms step's took 50 ms and left it a single sample per round). Also that fastest call (inf: none)."""
    calls = max(warmup, 2) if min_seconds > 0 else warmup
    fastest = float("inf")
    for _ in range(calls):
        t0 = timer()
        fn(n)
        fastest = min(fastest, timer() - t0)
    if min_seconds <= 0:
        return 1, fastest
    return int(min(cap, max(1, min_seconds // max(fastest, 1e-9)))), fastest


class _Samples:
    """Each job's timed samples and when they were taken; with a reference job re-timed before a job once ``every``
    seconds have passed, each sample is read against the reference's last timing before it (see
    ``measure_profile``'s ``reference_every``)."""

    def __init__(self, n_jobs: int, reference: int | None, every: float, timer: Callable[[], float]):
        self.times: list[list[float]] = [[] for _ in range(n_jobs)]
        self.at: list[list[float]] = [[] for _ in range(n_jobs)]
        self.reference, self.every, self.timer = reference, every, timer
        self._last = -float("inf")

    def run(self, jobs, j: int) -> None:
        if self.reference is not None and j != self.reference and self.timer() - self._last >= self.every:
            self.run(jobs, self.reference)
        fn, n = jobs[j]
        t0 = self.timer()
        fn(n)
        t1 = self.timer()
        self.times[j].append(t1 - t0)
        self.at[j].append((t0 + t1) / 2)
        if j == self.reference:
            self._last = t1

    def read(self, j: int) -> np.ndarray:
        """Job j's samples as the medians read them: each divided by the reference's last timing before it (or at
        it), times the reference's median; without a reference, as timed."""
        ts = np.asarray(self.times[j])
        if self.reference is None:
            return ts
        ref_at, ref_s = np.asarray(self.at[self.reference]), np.asarray(self.times[self.reference])
        before = ref_s[np.maximum(np.searchsorted(ref_at, self.at[j], side="right") - 1, 0)]
        return ts / before * float(np.median(ref_s))

    def medians(self) -> list[float]:
        return [float(np.median(self.read(j))) for j in range(len(self.times))]

    def relative_error(self, j: int) -> float:
        """The standard error of job j's median over the median (inf below 3 samples), from the samples' spread:
        1.2533 · 1.4826 · MAD / sqrt(n), robust to the one stall in a few hundred steps that a variance is not."""
        x = self.read(j)
        if len(x) < 3:
            return float("inf")
        mid = float(np.median(x))
        return 1.2533 * 1.4826 * float(np.median(np.abs(x - mid))) / (np.sqrt(len(x)) * mid) if mid > 0 else 0.0



def measure_profile(
    step_fn: Callable[[int], object],
    token_counts: Iterable[int],
    repeats: int = 5,
    *,
    warmup: int = 1,
    draft_fn: Callable[[int], object] | None = None,
    shallow_draft_fn: Callable[[int], object] | None = None,
    draft_depth: int = 0,
    depth_draft_fn: Callable[[int, int], object] | None = None,
    request_counts: Iterable[int] = (),
    one_segment_fn: Callable[[int], object] | None = None,
    tokens_per_segment: int = 0,
    grid_fn: Callable[[int, int], object] | None = None,
    grid_requests: Iterable[int] = (),
    grid_tokens: Iterable[int] = (),
    prefill_fn: Callable[[int, int], object] | None = None,
    prefill_requests: Iterable[int] = (),
    prefill_tokens: Iterable[int] = (),
    context_fn: Callable[[int, int], object] | None = None,
    context_cells: Iterable[tuple[int, int]] = (),
    context_tokens: tuple[int, int] = (0, 0),
    prefill_context_fn: Callable[[int], object] | None = None,
    prefill_context_at: tuple[int, int] = (0, 0),
    key: ProfileKey | None = None,
    timer: Callable[[], float] = time.perf_counter,
    min_job_seconds: float = 0.0,
    max_samples_per_round: int = 4,
    shuffle_seed: int | None = None,
    table_cell: Callable[[int], tuple[int, int] | None] | None = None,
    reference_every: float = 0.0,
    precise_requests: int = 0,
    precision: float = 0.01,
    precise_seconds: float = 0.0,
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
    shallow drafting; with ``depth_draft_fn(R, d)`` too, at every depth between (2 .. ``draft_depth`` - 1): a
    drafting step's cost is not linear in its depth where the drafter's row count crosses a kernel route (at R = 2
    on the dev CPU, 3.9 / 3.9 / 4.5 / 5.1 / 7.1 ms at depth 1 / 2 / 3 / 4 / 7, where the line through depths 1 and 7
    priced depth 2 at 4.4: results/profile-drift-s41/profile-noref-1.json), and the scheduler chooses between depths.
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
    With ``context_fn(R, k)`` (grid cell (R, k) with every request holding ``context_tokens[1]`` tokens of context
    instead of the grid's ``context_tokens[0]``) the ``context_cells`` (grid cells) are timed at that context too,
    in the same rounds, and ``fit_context_cost`` turns the differences into the profile's context prices.
    With ``prefill_context_fn(P)`` (a P-token prompt chunk alone, starting after ``prefill_context_at[1]`` tokens of
    its prompt) the chunk of ``prefill_context_at`` = (P, start) is timed too; against the prefill table's chunk of
    P alone (R = 0) it gives ``prefill_context_s``, the price of each chunk token per token before it.
    ``table_cell(B)`` names the grid cell (R, k) that runs the same step as ``step_fn(B)``, if any; such table
    points are read from the grid instead of being timed twice.
    With ``reference_every`` > 0 the cheapest step of the table or the grid (by its fastest warm-up call) is the
    reference: it is timed again before any job once that many seconds have passed since its last timing, each
    job's samples are divided by the reference's last time before them, and the median ratio is scaled by the
    reference's median time. The dev VM's speed drifts by up to 50 % within a minute (a plain step's 5-second
    medians ran from 17.6 to 26.8 ms, while a 2-request 3-token step's ratio to it stayed within 1.01-1.23:
    results/profile-drift-s41/drift.txt), and raw medians let the drift decide which of two close steps looks
    cheaper: two profiles measured minutes apart priced a 2-request step verifying 2 drafts each 1.7 and 1.0 ms
    over one verifying 1, and plain decoding of one request at 15.5 and 20.0 ms
    (results/profile-drift-s41/profile-noref-*.json).
    With ``precise_requests`` > 0 and ``precise_seconds`` > 0, the steps of at most that many requests (grid cells,
    table points, proposals) are timed in further shuffled sub-rounds after the ``repeats`` rounds, each sub-round
    over those whose median's standard error (``_Samples.relative_error``) is still above ``precision``, until none
    is or ``precise_seconds`` have passed (at most as long as the rounds took: a tiny model's profile stays quick);
    ``source`` then says the worst error left. At low load the scheduler
    weighs prices a few per cent apart: on the AVX2 EPYC of sessions 50-51 a step's time scattered by ~10 % from one
    sample to the next even read against the reference (results/phase-ratios-s51), so the ~18 samples of a cheap
    cell left its price ~3 % off; the profile there priced a 2-request step verifying a draft each at 1.11x a plain
    one where the engine ran it at 1.16x, and a 1-request step of 3 tokens at 1.00x one of 2 where it cost 1.12x,
    and the async scheduler drafted where plain decoding, and MTP-1, were faster.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if not (reference_every >= 0):
        raise ValueError(f"reference_every must be >= 0 (0: no reference), got {reference_every!r}")
    if precise_requests < 0 or not (precise_seconds >= 0) or not (precision > 0):
        raise ValueError(f"need precise_requests >= 0, precise_seconds >= 0 and precision > 0, got "
                         f"{precise_requests!r}, {precise_seconds!r}, {precision!r}")
    if not (min_job_seconds >= 0) or max_samples_per_round < 1:
        raise ValueError(f"min_job_seconds must be >= 0 and max_samples_per_round >= 1, got {min_job_seconds!r}, "
                         f"{max_samples_per_round!r}")

    def median_times(jobs: list[tuple[Callable[[int], object], int]], targets: int,
                     precise: list[int]) -> tuple[list[float], float]:
        """Median seconds of each job, and the worst relative error left among the ``precise`` jobs (0: none);
        the reference is the cheapest of the first ``targets`` (the target's steps: the drafter's weights fit in
        cache where the target's stream from memory, so they drift differently)."""
        warm = [_samples_per_round(fn, n, warmup, min_job_seconds, max_samples_per_round, timer) for fn, n in jobs]
        reps = [k for k, _ in warm]
        reference = min(range(targets), key=lambda j: warm[j][1]) if reference_every > 0 and targets else None
        samples = _Samples(len(jobs), reference, reference_every, timer)
        started = timer()
        rng = random.Random(shuffle_seed)
        for _ in range(repeats):
            for sub in range(max(reps)):  # sub-rounds keep a cheap job's extra samples spread over the round
                visit = [j for j, k in enumerate(reps) if sub < k]
                if shuffle_seed is not None:
                    rng.shuffle(visit)
                for j in visit:
                    samples.run(jobs, j)
        deadline = timer() + min(precise_seconds, timer() - started)  # at most doubling the measurement
        while precise_seconds > 0 and timer() < deadline:
            visit = [j for j in precise if samples.relative_error(j) > precision]
            if not visit:
                break
            if shuffle_seed is not None:
                rng.shuffle(visit)
            for j in visit:
                if timer() >= deadline:
                    break
                samples.run(jobs, j)
        return samples.medians(), max((samples.relative_error(j) for j in precise), default=0.0)

    tokens = sorted({int(b) for b in token_counts})
    segments = max(1, tokens[-1] // tokens_per_segment) if tokens_per_segment else 1
    split_both = one_segment_fn is not None and segments > 1
    g_req = sorted({int(r) for r in grid_requests}) if grid_fn is not None else []
    g_tok = sorted({int(k) for k in grid_tokens}) if g_req else []
    grid_jobs = [(functools.partial(grid_fn, r), k) for r in g_req for k in g_tok]
    p_req = sorted({int(r) for r in prefill_requests}) if prefill_fn is not None else []
    p_tok = sorted({int(p) for p in prefill_tokens}) if p_req else []
    prefill_jobs = [(functools.partial(prefill_fn, r), p) for r in p_req for p in p_tok]
    c_cells = [(int(r), int(k)) for r, k in context_cells if r in g_req and k in g_tok] if context_fn else []
    context_jobs = [(functools.partial(context_fn, r), k) for r, k in c_cells]
    p_at, p_start = (int(x) for x in prefill_context_at)
    later = prefill_context_fn is not None and 0 in p_req and p_at in p_tok and p_start > 0
    later_jobs = [(prefill_context_fn, p_at)] if later else []  # a prompt's later chunk, alone
    reqs: list[int] = sorted({int(r) for r in request_counts}) if draft_fn is not None else []
    shallow = shallow_draft_fn is not None and draft_fn is not None and draft_depth >= 2
    mid = list(range(2, draft_depth)) if shallow and depth_draft_fn is not None else []
    draft_jobs = ([(draft_fn, r) for r in reqs] + ([(shallow_draft_fn, r) for r in reqs] if shallow else [])
                  + [(functools.partial(depth_draft_fn, r), d) for d in mid for r in reqs])
    draft_loads = reqs * (1 + shallow + len(mid))  # each drafting job's request count
    # Drafting is timed in the same rounds as the target's steps: the scheduler weighs one against the other, so
    # a slow phase must not land on one block of them only; and each proposal then follows a target forward, as
    # in the engine, where the target has just pushed the drafter's weights out of the caches.
    # A table point that is the same step as a grid cell (one request of B tokens is cell (1, B)) takes that
    # cell's samples rather than being timed again: half the table duplicated the grid, in twice the time.
    cells = {rk: i for i, rk in enumerate((r, k) for r in g_req for k in g_tok)}
    same = {b: cells.get(table_cell(b)) for b in tokens} if table_cell is not None else {}
    own = [b for b in tokens if same.get(b) is None]
    target_jobs = [(step_fn, b) for b in own] + ([(one_segment_fn, tokens[-1])] if split_both else []) + grid_jobs
    # the low-load steps timed to ``precision``: their request counts, job by job (0: not one of them)
    loads = ([max(1, b // tokens_per_segment) if tokens_per_segment else 1 for b in own] + [0] * int(split_both)
             + [r for r in g_req for _ in g_tok] + [0] * (len(prefill_jobs) + len(context_jobs) + len(later_jobs))
             + draft_loads)
    precise = [j for j, r in enumerate(loads) if 0 < r <= precise_requests]
    t, error = median_times(target_jobs + prefill_jobs + context_jobs + later_jobs + draft_jobs, len(target_jobs),
                            precise)
    own_s, t = dict(zip(own, t[:len(own)])), t[len(own):]
    one_request, t = (t[0] if split_both else 0.0), t[int(split_both):]
    grid_flat, t = t[:len(grid_jobs)], t[len(grid_jobs):]
    prefill_flat, t = t[:len(prefill_jobs)], t[len(prefill_jobs):]
    context_flat, t = t[:len(context_jobs)], t[len(context_jobs):]
    later_flat, t = t[:len(later_jobs)], t[len(later_jobs):]
    dsec, shallow_sec, t = t[:len(reqs)], t[len(reqs):len(reqs) * (1 + shallow)], t[len(reqs) * (1 + shallow):]
    mid_sec = tuple(tuple(t[i * len(reqs):(i + 1) * len(reqs)]) for i in range(len(mid)))
    seconds = [own_s[b] if same.get(b) is None else grid_flat[same[b]] for b in tokens]
    grid = tuple(tuple(grid_flat[i * len(g_tok):(i + 1) * len(g_tok)]) for i in range(len(g_req)))
    seg_s = max(0.0, (seconds[-1] - one_request) / (segments - 1)) if split_both else 0.0
    per_request_s = per_token_s = prefill_context_s = 0.0
    if later_flat:  # the later prompt chunk against the same chunk from the start of its prompt
        alone = prefill_flat[p_req.index(0) * len(p_tok) + p_tok.index(p_at)]
        prefill_context_s = max(0.0, (later_flat[0] - alone) / (p_at * p_start))
    if c_cells and context_tokens[1] != context_tokens[0]:
        deltas = [long - grid_flat[cells[rk]] for rk, long in zip(c_cells, context_flat)]
        per_request_s, per_token_s = fit_context_cost(c_cells, deltas, context_tokens[1] - context_tokens[0])
    return SpeedProfile(tuple(tokens), tuple(seconds), tuple(reqs), tuple(dsec), key=key,
                        source=f"measured (steps of <= {precise_requests} requests to ±{100 * error:.1f} %)"
                        if precise and precise_seconds > 0 else "measured",
                        segment_seconds=seg_s, tokens_per_segment=tokens_per_segment if split_both else 0,
                        shallow_draft_seconds=tuple(shallow_sec), draft_depth=draft_depth if shallow else 0,
                        depth_draft_seconds=mid_sec,
                        grid_requests=tuple(g_req), grid_tokens=tuple(g_tok), grid_seconds=grid,
                        prefill_requests=tuple(p_req), prefill_tokens=tuple(p_tok),
                        prefill_seconds=tuple(tuple(prefill_flat[i * len(p_tok):(i + 1) * len(p_tok)])
                                              for i in range(len(p_req))),
                        grid_context=int(context_tokens[0]) if c_cells else 0, context_request_s=per_request_s,
                        context_token_s=per_token_s, prefill_context_s=prefill_context_s)


def fit_context_cost(cells: list[tuple[int, int]], deltas: list[float], more_context: int) -> tuple[float, float]:
    """(seconds per request, seconds per verified token) of each context token more, fitted to the extra time
    ``deltas`` that ``more_context`` more tokens of context added to grid cells (R, k) = ``cells``: least squares
    of delta / more_context = a·R + b·R·k with a, b >= 0 (a negative one is dropped and the other refitted; a
    noisy machine must not make context look free or negative)."""
    x = np.array([[r, r * k] for r, k in cells], dtype=np.float64)  # [n, 2]
    y = np.asarray(deltas, dtype=np.float64) / more_context  # [n]
    coef = np.linalg.lstsq(x, y, rcond=None)[0] if len(cells) >= 2 else np.array([-1.0, -1.0])
    if (coef < 0).any():  # the best one-coefficient fit instead
        fits = [np.zeros(2)]
        for j in (0, 1):
            c = np.zeros(2)
            c[j] = max(0.0, float(x[:, j] @ y) / float(x[:, j] @ x[:, j]))
            fits.append(c)
        coef = min(fits, key=lambda c: float(np.sum((x @ c - y) ** 2)))
    return float(coef[0]), float(coef[1])
