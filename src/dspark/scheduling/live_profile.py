"""A speed profile whose prices follow the step times the engine measures while it serves.

The profile (profile.py) is measured once and cached, but the machines this project runs on drift: on the dev VM
a one-token step cost 35.9 ms in one stretch and 27.8 ms twenty minutes later, and not by the same factor for
every step shape, so the async scheduler priced K from a curve that no longer held (README, session 21: with the
stale profile it drafted 0.70 tokens per step at C = 1 where MTP-1's 0.99 paid 11 %). What the scheduler compares
is a plain step against a verify step (and the drafting that the verify step needs), so a uniform slow-down
changes nothing; what misleads it is one of them drifting against the others.

``LiveProfile`` keeps three correction factors, measured over cached (base) prices:

  * plain  — target forwards in which every request verifies only its anchor (B = R);
  * verify — target forwards with at least one draft verified (B > R);
  * draft  — the drafter's proposal (its ``propose`` call, feeding excluded), priced by the drafting tables.

Each factor is the median of its class's last ``window`` measured / predicted ratios that are younger than
``max_age`` reports (a median, because one step in a few hundred stalls for 2-5x on a shared VM; the ageing and
what a class without enough young samples falls back to: ``LiveProfile``). The
scheduler reads ``current``: the base profile with its grid's k = 1 column scaled by the plain factor, the other
columns by the verify factor (so a step of R requests verifying k in (1, 2) tokens each blends the two, as the
grid already does between those columns), and the drafting tables by the draft factor. ``current`` is rebuilt
only when a factor has moved by more than ``tolerance`` since it was last built, so the scheduler's memo of K
(keyed on ``rebuilds``) survives the noise.

Measured in session 22 (README): the target's factors stayed within 0.94–1.06 on a host that did not drift, and
the drafting factor settled at 0.77–0.84 serving T = 0 — the profile times proposals with T = 1 sampling, whose
draws cost more — so even without drift the live prices remove a bias of the cached ones.

Lossless: the factors come from the durations of steps already taken, never from the current step's tokens, so
K and every decision made from it stay independent of the drafts they admit (DESIGN.md §1). They do make the
decisions depend on wall-clock time, so with live prices a seeded sampled request is exact in distribution but
need not repeat token for token from run to run (a fixed profile keeps that).
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque

from .profile import SpeedProfile

CLASSES = ("plain", "verify", "draft")


def rescaled(profile: SpeedProfile, plain: float = 1.0, verify: float = 1.0, draft: float = 1.0) -> SpeedProfile:
    """``profile`` with target steps that verify no draft priced × ``plain``, the others × ``verify``, and drafting
    × ``draft``. Without a grid, the B-table cannot tell the classes apart and all its steps take ``verify``."""
    grid = tuple(tuple(s * (plain if k == 1 else verify) for k, s in zip(profile.grid_tokens, row))
                 for row in profile.grid_seconds)
    return dataclasses.replace(
        profile,
        seconds=tuple(s * verify for s in profile.seconds),
        segment_seconds=profile.segment_seconds * verify,
        grid_seconds=grid,
        draft_seconds=tuple(s * draft for s in profile.draft_seconds),
        shallow_draft_seconds=tuple(s * draft for s in profile.shallow_draft_seconds),
        depth_draft_seconds=tuple(tuple(s * draft for s in row) for row in profile.depth_draft_seconds),
        source=f"{profile.source} (live ×{plain:.3f} plain, ×{verify:.3f} verify, ×{draft:.3f} draft)",
    )


def _cached(prices: dict[tuple, float], shape: tuple, price) -> float:
    """``price(*shape)`` as a float, computed once per shape."""
    if shape not in prices:
        prices[shape] = float(price(*shape))
    return prices[shape]


class LiveProfile:
    """Correction factors over a cached profile, from the engine's measured steps; ``current`` is what to price
    with. Feed it with ``observe_forward`` and ``observe_draft`` (the engine does, through the policy).

    A class's samples count only while they are younger than ``max_age`` reports: a scheduler that drafts every
    step takes no plain step for minutes, and its plain factor would hold whatever the first few plain steps said
    (in session 22 it held 1.27 for a whole run — they came from the warm-up — and made every verify step look
    27 % cheaper against plain decoding than it was). A target class without enough young samples takes the other
    target class's factor (no news of the two drifting apart: keep the profile's ratio between them); with neither,
    and for drafting, 1.0, the cached price."""

    def __init__(self, base: SpeedProfile, window: int = 32, min_samples: int = 6, tolerance: float = 0.02,
                 max_age: int = 256):
        if not isinstance(base, SpeedProfile):
            raise TypeError(f"live prices need a measured SpeedProfile to correct, got {type(base).__name__}")
        if window < 1 or not 1 <= min_samples <= window:
            raise ValueError(f"need window >= 1 and 1 <= min_samples <= window, got {window}, {min_samples}")
        if not 0.0 <= tolerance < 1.0:
            raise ValueError(f"tolerance must lie in [0, 1), got {tolerance}")
        if max_age < min_samples:
            raise ValueError(f"max_age must be >= min_samples = {min_samples}, got {max_age}")
        self.base, self.window, self.min_samples, self.tolerance = base, window, min_samples, tolerance
        self.max_age = max_age
        self.reset()

    def reset(self) -> None:
        self._ratios = {c: deque(maxlen=self.window) for c in CLASSES}  # (report number, measured / cached)
        self._reports = 0
        self._factors = {c: 1.0 for c in CLASSES}
        self._built = dict(self._factors)  # the factors `current` was built with
        # Cached prices, by (B, R) and (R, depth): the engine meets few shapes, and pricing one from the grid costs
        # ~45 us, which every step paid twice (observing cost ~0.2 ms a step, 1.8 % of a one-request step).
        self._step_price: dict[tuple[int, int], float] = {}
        self._draft_price: dict[tuple[int, int], float] = {}
        self.current = self.base
        self.rebuilds = 0

    def factor(self, cls: str) -> float:
        """The class's correction now: the median measured / cached ratio of its young samples (see the class)."""
        return self._factors[cls]

    def factors(self) -> dict[str, float]:
        return dict(self._factors)

    def observe_forward(self, n_tokens: int, n_requests: int, seconds: float, context: float = 0) -> None:
        """A target forward of ``n_requests`` requests verifying ``n_tokens`` tokens in all (anchors included)
        that took ``seconds``, the requests holding ``context`` tokens of context on average (0: the profile's);
        forwards with prefill in them are not what the profile prices: leave them out. The prediction is priced at
        that context, so that long contexts are not mistaken for a slower machine (the policy prices them itself)."""
        if n_requests < 1 or n_tokens < n_requests:
            raise ValueError(f"a verify step has n_tokens >= n_requests >= 1, got {n_tokens}, {n_requests}")
        predicted = _cached(self._step_price, (n_tokens, n_requests, context),
                            lambda b, r, ctx: self.base.at_context(ctx).step_s(b, r))
        self._add("plain" if n_tokens == n_requests else "verify", seconds, predicted)

    def observe_step(self, n_tokens: int, n_requests: int, forward_s: float, context: float = 0, drafted: int = 0,
                     depth: int = 0, draft_s: float = 0.0, commit_s: float = 0.0, feed_s: float = 0.0,
                     overhead: bool = True) -> None:
        """One engine step with no prefill in it, as the engine reports it (``AsyncPolicy.observe_step``): with
        ``overhead`` the forward is priced with its commit and the proposal (if ``drafted`` > 0 requests) with the
        feed of the states the drafter had not seen, since the engine's own work is part of what a step costs."""
        if overhead:
            forward_s, draft_s = forward_s + commit_s, draft_s + feed_s
        self.observe_forward(n_tokens, n_requests, forward_s, context)
        if drafted:
            self.observe_draft(drafted, depth, draft_s)

    def observe_draft(self, n_requests: int, depth: int, seconds: float) -> None:
        """One proposal of ``depth`` slots for ``n_requests`` requests that took ``seconds``."""
        if not self.base.draft_requests:
            return  # drafting is not priced: nothing to correct
        self._add("draft", seconds, _cached(self._draft_price, (n_requests, depth), self.base.draft_s))

    def _young_median(self, cls: str) -> float | None:
        oldest = self._reports - self.max_age
        young = sorted(r for n, r in self._ratios[cls] if n > oldest)  # <= window floats: cheaper than numpy
        if len(young) < self.min_samples:
            return None
        mid = len(young) // 2
        return young[mid] if len(young) % 2 else 0.5 * (young[mid - 1] + young[mid])

    def _add(self, cls: str, seconds: float, predicted: float) -> None:
        if not (math.isfinite(seconds) and seconds > 0) or predicted <= 0:
            return  # a clock that did not move (or a broken one) says nothing about the price
        self._reports += 1
        self._ratios[cls].append((self._reports, seconds / predicted))
        plain, verify, draft = (self._young_median(c) for c in CLASSES)
        self._factors = {"plain": plain or verify or 1.0, "verify": verify or plain or 1.0, "draft": draft or 1.0}
        if any(abs(self._factors[c] / self._built[c] - 1.0) > self.tolerance for c in CLASSES):
            self._built = dict(self._factors)
            self.current = rescaled(self.base, **self._built)
            self.rebuilds += 1
