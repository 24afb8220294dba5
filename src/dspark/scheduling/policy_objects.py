"""The stateless policy objects (none / mtp1 / fixed-k, sync, threshold) and the error for a missing confidence head.

Every policy has ``prepare(n_requests, context=None) -> bool`` (call before drafting a step: should the drafter
run? ``context``, the running requests' mean context, is passed only to policies with ``prices_context``) and
``select(c, *, n_requests=None, gamma=None) -> lengths [R]`` where ``c`` is [R, γ] calibrated confidences, or
None when the drafter did not run or has no confidence head. Policies that ignore confidences (none, mtp1,
fixed) accept None as long as R and γ are given; the others raise ``ConfidenceRequiredError`` — e.g. for a
drafter without a confidence head (DFlash, Eagle3, n-gram) — naming the policies that do work. The stateful
asynchronous scheduler is in ``async_policy.py``; names and factories in ``registry.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .policies import SPS, rounded_context, as_confidences, fixed_k, static_threshold, sync_prefix_schedule

CONFIDENCE_FREE = ("none", "mtp1", "fixed")  # registry names whose policies ignore confidences (a test checks)


class ConfidenceRequiredError(ValueError):
    """A confidence-based policy was asked to run without confidences."""


def need_confidences(name: str, c) -> np.ndarray:
    if c is None:
        raise ConfidenceRequiredError(
            f"policy {name!r} needs calibrated confidences, but the drafter provides none (no confidence head); "
            f"policies that work without confidences: {', '.join(CONFIDENCE_FREE)}"
        )
    return as_confidences(c)


def _shape(c, n_requests: int | None, gamma: int | None) -> tuple[int, int]:
    if c is not None:
        return tuple(np.shape(c))  # type: ignore[return-value]
    if n_requests is None or gamma is None:
        raise ValueError("without confidences, pass n_requests and gamma")
    return int(n_requests), int(gamma)


@dataclass(frozen=True)
class FixedPolicy:
    """Verify min(k, γ) drafts per request (k = 0: no speculation, k = 1: MTP-1)."""

    k: int
    needs_confidence = False
    load_dependent = False  # how many drafts a request verifies never depends on the other requests

    @property
    def name(self) -> str:
        return {0: "none", 1: "mtp1"}.get(self.k, f"fixed-{self.k}")

    @property
    def drafts(self) -> bool:  # plain decoding never runs the drafter (and never pays for it)
        return self.k > 0

    def prepare(self, n_requests: int, context: float | None = None) -> bool:
        return self.drafts

    def draft_depth(self, gamma: int) -> int:
        """Slots worth drafting: never more than this policy verifies."""
        return min(self.k, gamma)

    def select(self, c=None, *, n_requests: int | None = None, gamma: int | None = None) -> np.ndarray:
        r, g = _shape(c, n_requests, gamma)
        return fixed_k(r, g, self.k)


class _ChoosesAfterDrafting:
    """Policies that read the current step's confidences: the drafter runs every step."""

    needs_confidence = True
    drafts = True

    def prepare(self, n_requests: int, context: float | None = None) -> bool:
        return True


@dataclass
class SyncPolicy(_ChoosesAfterDrafting):
    """Paper Algorithm 1 (greedy with early stop); ``unsafe=True`` removes the early stop (biased output).
    Prices each step at the running requests' mean context when the profile prices context (``prepare``)."""

    sps: SPS
    unsafe: bool = False
    load_dependent = True  # the batch's confidences and the step's price set every request's length
    prices_context = True
    _priced: SPS | None = field(default=None, init=False, repr=False, compare=False)  # sps at this step's context

    @property
    def name(self) -> str:
        return "sync-unsafe" if self.unsafe else "sync"

    def prepare(self, n_requests: int, context: float | None = None) -> bool:
        at = getattr(self.sps, "at_context", None)
        self._priced = at(rounded_context(context)) if context and at else None
        return True

    def select(self, c=None, *, n_requests: int | None = None, gamma: int | None = None) -> np.ndarray:
        return sync_prefix_schedule(need_confidences(self.name, c), self._priced or self.sps, unsafe=self.unsafe)


@dataclass(frozen=True)
class ThresholdPolicy(_ChoosesAfterDrafting):
    """Static threshold on per-slot confidence (or on survival with ``cumulative=True``)."""

    threshold: float
    cumulative: bool = False
    load_dependent = False  # each request's own confidences alone set its length

    @property
    def name(self) -> str:
        return f"threshold-{self.threshold:g}"

    def select(self, c=None, *, n_requests: int | None = None, gamma: int | None = None) -> np.ndarray:
        return static_threshold(need_confidences("threshold", c), self.threshold, cumulative=self.cumulative)
