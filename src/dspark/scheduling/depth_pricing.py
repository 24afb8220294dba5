"""K and the drafted depth priced together: the async scheduler's choice at low load (``AsyncPolicy``'s
``joint_requests``).

Pricing K alone assumes every request drafts K + 1 slots. At R = 2 that charges K = 4 five drafted slots a request,
while two requests verifying two drafts each need two, which is fixed-2's step. Here every depth d up to the
deepest any pooled step drafted is priced from the pooled steps that drafted at least d slots, truncated to d, and
the best (K <= R·d, d) wins. Shapes as in ``policies.py``.
"""

from __future__ import annotations

import functools

import numpy as np

from .policies import SPS, quantile_gains, sps_values
from .profile import SpeedProfile


def depth_survivals(c: np.ndarray) -> np.ndarray:
    """One step's validated confidences [R, d] -> [d, R·d]: row i holds the descending survivals of its first i + 1
    slots (``step_survivals`` of c[:, :i + 1]), zero-padded: what pricing a shallower draft needs of the step."""
    a = np.cumprod(c, axis=1)
    if a.shape[0] == 1:  # one request: its survivals already descend along the row
        return np.tril(np.broadcast_to(a[0], (a.size, a.size)))
    out = np.zeros((a.shape[1], a.size))
    for depth in range(1, a.shape[1] + 1):
        out[depth - 1, :a.shape[0] * depth] = -np.sort(-a[:, :depth].ravel())
    return out


def capacity_and_depth(by_depth: list[np.ndarray], rows: list[int], sps: SPS,
                       n_requests: int) -> tuple[int, int, float]:
    """The best (K, depth) to draft and verify, and its Θ / Θ_0: K from 1..R·depth, depth from 1 to the deepest
    any pooled step drafted, each depth priced from the pooled steps that drafted at least that many slots (their
    ``depth_survivals``; ``rows`` their R_old), truncated to it, with drafting at that depth. (0, 0, 1.0) when no
    step is pooled.

    Ties go to the shallower depth, then the smaller K. Each depth's expected gains are ``pooled_gains`` of the
    steps truncated to it, summed in the same order, so a slow reference that truncates and pools per depth agrees
    with it."""
    base = int(n_requests)
    if base <= 0 or not by_depth:
        return 0, 0, 1.0
    deepest = max(m.shape[0] for m in by_depth)
    n = base * deepest
    scaled, same, weight = np.zeros((deepest, n + 1)), np.zeros((deepest, n)), np.zeros(deepest)
    for m, r in zip(by_depth, rows):
        weight[:m.shape[0]] += r
        if r == base:
            same[:m.shape[0], :m.shape[1]] += m
            continue
        for i in range(m.shape[0]):  # a step of other R: its top f·K survivals (see pooled_gains)
            scaled[i] += quantile_gains(m[i, :r * (i + 1)], r, base, n)
    scaled[:, 1:] += base * np.cumsum(same, axis=1)
    known = weight > 0
    theta = np.full((deepest, n + 1), -np.inf)
    theta[known] = (base + scaled[known] / weight[known, None]) * _joint_prices(sps, base, deepest)[known]
    theta[:, 0] = -np.inf  # K = 0 is plain decoding, priced below without the drafter
    depth, k = np.unravel_index(int(np.argmax(theta)), theta.shape)  # row-major: the shallower depth first
    plain = base * float(_plain_sps(sps, base))
    if plain <= 0:
        return int(k), int(depth) + 1, (float("inf") if theta[depth, k] > 0 else 1.0)
    return int(k), int(depth) + 1, float(theta[depth, k]) / plain


def _plain_sps(sps: SPS, base: int) -> float:
    """Steps per second of plain decoding (no drafter) for ``base`` requests."""
    if isinstance(sps, SpeedProfile):
        return _profile_plain_sps(sps, base)
    return float(sps_values(sps, np.array([base]), base)[0])


@functools.lru_cache(maxsize=512)
def _profile_plain_sps(sps: SpeedProfile, base: int) -> float:
    return 1.0 / float(sps.step_s(base, n_requests=base))  # cached: pricing from the grid is ~0.1 ms a call


def _joint_prices(sps: SPS, base: int, deepest: int) -> np.ndarray:
    """SPS of a step of ``base`` requests verifying K = 0..base·deepest drafts with d = 1..deepest slots drafted
    -> [deepest, base·deepest + 1]; K > base·d cannot happen at depth d and is priced -inf."""
    if isinstance(sps, SpeedProfile):
        return _profile_joint_prices(sps, base, deepest)
    return _joint_price_table(sps, base, deepest)


@functools.lru_cache(maxsize=512)
def _profile_joint_prices(sps: SpeedProfile, base: int, deepest: int) -> np.ndarray:
    prices = _joint_price_table(sps, base, deepest)
    prices.flags.writeable = False  # shared between calls
    return prices


def _joint_price_table(sps: SPS, base: int, deepest: int) -> np.ndarray:
    n = base * deepest
    prices = np.full((deepest, n + 1), -np.inf)
    for depth in range(1, deepest + 1):
        k = np.arange(base * depth + 1)
        prices[depth - 1, :k.size] = sps_values(sps, base + k, base, np.full(k.size, depth))
    return prices
