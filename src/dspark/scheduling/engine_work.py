"""The engine's own work in a serving step, priced into a speed profile as seconds added, not as a factor.

The profile times a target forward and a drafter proposal in isolation (profile_measure.py). A serving step is more:
after the forward the commit (sampling, rejection sampling of the verified drafts, emitting tokens), and before a
proposal the feed of the target states the drafter has not seen; the proposal itself runs with its weights evicted by
the forward. Until session 49 (profile format 13) this was priced as three factors — plain forwards, verify
forwards and proposals each scaled by their median measured / profiled ratio in a short engine run — but a
forward's time wanders by ±5 % from one stretch of seconds to the next on these shared 2-core machines, while the
commit it was meant to price is ~0.5-1.6 ms of a ~23 ms step, so the factors priced the wandering: the profiles
cached on the Intel Xeon in sessions 48 and 49 priced a step of 4 requests verifying 2 tokens each at 1.03x and
1.15x the plain step of 4 requests, from raw grids 6 % and 5 % apart (factors x1.083 plain / x1.052 verify against
x0.997 / x1.087; results/engine-work-s49/cached-profiles.txt) — 3 ms, more than drafting gains at C = 4.

The commit and the feed are timed by themselves, and their medians are steady (10-90 % within ±15 % of ~1 ms), so
they are fitted as lines — commit per step, per request and per verified draft; feed per drafting step and per
drafted request — and added to the tables; only the proposal keeps a factor (it came out at 1.00-1.01: the profile
times proposals beside forwards, as the engine runs them; what the format-13 drafting factor of 1.2-1.3 priced was
the feed). The forwards stay as measured. Four calibrations back to back (scripts/engine_work_probe.py,
results/engine-work-s49) fitted commit 0.44-0.50 ms + 0.05-0.08 ms a request, verification 0.24-0.34 ms + 0.06-0.07
ms a draft, feed 0.61-0.66 ms + 0.10-0.11 ms a request.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from statistics import median

import numpy as np

from .profile import SpeedProfile


@dataclass(frozen=True)
class EngineWork:
    """Seconds a serving step adds to the profile's forward and proposal (all >= 0; draft_factor > 0)."""

    commit_s: float = 0.0  # every step's commit: its fixed part
    commit_request_s: float = 0.0  # ... and per request in the step
    verify_s: float = 0.0  # a step that verifies drafts: the rejection sampling's fixed part
    verify_draft_s: float = 0.0  # ... and per verified draft
    feed_s: float = 0.0  # a drafting step's feed of new target states: fixed part
    feed_request_s: float = 0.0  # ... and per drafted request
    draft_factor: float = 1.0  # a proposal in the engine / the profile's proposal of that size

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"EngineWork.{f.name} must be a finite number >= 0, got {value!r}")
        if self.draft_factor <= 0:
            raise ValueError(f"EngineWork.draft_factor must be > 0, got {self.draft_factor!r}")

    def step_s(self, n_requests: float, n_drafts: float) -> float:
        """Seconds a step of ``n_requests`` requests verifying ``n_drafts`` drafts in all adds to its forward."""
        verify = self.verify_s + self.verify_draft_s * n_drafts if n_drafts > 0 else 0.0
        return self.commit_s + self.commit_request_s * n_requests + verify

    def feed(self, n_requests: float) -> float:
        return self.feed_s + self.feed_request_s * n_requests

    def describe(self) -> str:
        ms = lambda s: f"{1e3 * s:.3f}"  # noqa: E731
        return (f"engine work: commit {ms(self.commit_s)} + {ms(self.commit_request_s)}/request ms, verify "
                f"{ms(self.verify_s)} + {ms(self.verify_draft_s)}/draft ms, feed {ms(self.feed_s)} + "
                f"{ms(self.feed_request_s)}/request ms, drafting x{self.draft_factor:.3f}")


def priced_in(profile: SpeedProfile, work: EngineWork) -> SpeedProfile:
    """``profile`` with ``work`` added to every table: the (R, k) grid (R requests verifying k tokens each), the
    B-table (B tokens over max(1, B // tokens_per_segment) requests), the prefill table (its decoding requests' commit:
    a prompt's own extra time stays what was measured) and the drafting tables (× draft_factor, + the feed of R
    requests). The per-request commit also joins ``segment_seconds``, the price of a request where the B-table
    extrapolates."""
    grid = tuple(tuple(s + work.step_s(r, r * (k - 1)) for k, s in zip(profile.grid_tokens, row))
                 for r, row in zip(profile.grid_requests, profile.grid_seconds))
    tps = profile.tokens_per_segment
    table = tuple(s + work.step_s(max(1, b // tps) if tps else 1, b - (max(1, b // tps) if tps else 1))
                  for b, s in zip(profile.tokens, profile.seconds))
    prefill = tuple(tuple(s + work.step_s(r, 0) for s in row)
                    for r, row in zip(profile.prefill_requests, profile.prefill_seconds))

    def drafting(seconds, requests=profile.draft_requests):
        return tuple(s * work.draft_factor + work.feed(r) for r, s in zip(requests, seconds))

    return dataclasses.replace(
        profile, seconds=table, grid_seconds=grid, prefill_seconds=prefill,
        segment_seconds=profile.segment_seconds + (work.commit_request_s if tps else 0.0),
        draft_seconds=drafting(profile.draft_seconds), shallow_draft_seconds=drafting(profile.shallow_draft_seconds),
        depth_draft_seconds=tuple(drafting(row) for row in profile.depth_draft_seconds),
        source=f"{profile.source}, {work.describe()}")


@dataclass
class StepSample:
    """One decode-only engine step as timed (the engine's ``observe_step`` report)."""

    n_requests: int
    n_tokens: int  # verified tokens, anchors included
    commit_s: float
    drafted: int = 0  # requests drafted for
    depth: int = 0
    draft_s: float = 0.0  # the proposal alone
    feed_s: float = 0.0
    forward_s: float = 0.0  # the target forward (diagnostics: what the factors of format 13 divided)


def fit(samples: list[StepSample], profile: SpeedProfile) -> EngineWork:
    """EngineWork from timed steps at two or more request counts (one: no per-request parts), medians per shape:
    commit = a + b·R on plain steps; a verify step's commit over the plain one of its R = c + d·drafts (least
    squares, through the origin if c would be negative); feed = e + f·R over drafting steps; the proposal's median
    engine / profiled ratio. Lines are clipped at 0: a noisy slope never prices work below nothing."""
    plain = _medians([s for s in samples if s.n_tokens == s.n_requests], lambda s: s.n_requests, "commit_s")
    commit_s, commit_request_s = _line(plain)
    base = dict(plain)
    extra = [(n_drafts, m - base[r]) for (r, n_drafts), m in
             _medians([s for s in samples if s.n_tokens > s.n_requests and s.n_requests in base],
                      lambda s: (s.n_requests, s.n_tokens - s.n_requests), "commit_s")]
    verify_s, verify_draft_s = _line(extra)
    drafting = [s for s in samples if s.drafted]
    feed_s, feed_request_s = _line(_medians(drafting, lambda s: s.drafted, "feed_s"))
    ratios = [s.draft_s / p for s in drafting if (p := float(profile.draft_s(s.drafted, s.depth))) > 0 and s.draft_s > 0]
    return EngineWork(commit_s=commit_s, commit_request_s=commit_request_s, verify_s=verify_s,
                      verify_draft_s=verify_draft_s, feed_s=feed_s, feed_request_s=feed_request_s,
                      draft_factor=median(ratios) if ratios else 1.0)


def _medians(samples: list[StepSample], key, field: str) -> list[tuple]:
    groups: dict = {}
    for s in samples:
        groups.setdefault(key(s), []).append(getattr(s, field))
    return sorted((k, median(v)) for k, v in groups.items())


def _line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(intercept, slope) >= 0 of the least-squares line through (x, y); one x: (y, 0); none: (0, 0)."""
    if not points:
        return 0.0, 0.0
    x, y = (np.array(v, dtype=np.float64) for v in zip(*points))
    if np.ptp(x) == 0:
        return max(0.0, float(y.mean())), 0.0
    slope, intercept = np.polyfit(x, y, 1)
    if intercept < 0:  # through the origin
        return 0.0, max(0.0, float(x @ y / (x @ x)))
    if slope < 0:
        return max(0.0, float(y.mean())), 0.0
    return float(intercept), float(slope)
