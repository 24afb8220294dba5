"""K and the drafted depth priced together: the async scheduler's choice at low load (``AsyncPolicy``'s
``joint_requests``).

Pricing K alone assumes every request drafts K + 1 slots. At R = 2 that charges K = 4 five drafted slots a request,
while two requests verifying two drafts each need two, which is fixed-2's step. Here every depth d up to the
deepest any pooled step drafted is priced, and the best (d <= K <= R·d, d) wins. Shapes as in ``policies.py``.

Each depth's gains are chained from the shallower ones: gains(d) = gains(d - 1) × what slot d multiplies them by,
the factor measured on the pooled steps that drafted at least d slots (their gains truncated to d over the same
steps' truncated to d - 1). At one request that is the survival to slot d - 1 from every step that drafted it,
times slot d's acceptance given slot d - 1 from the steps that drafted d. Pricing depth d from those deep steps
alone (until session 52) compared depths on different samples: the few deep steps (probes after skipped steps,
exploring steps) were a thin, unrepresentative sample, so at one request K = 1 was drafted 2-7 slots deep in a
third of its steps, for slots it could never verify, and the drafter took 7.9 ms a drafting step against MTP-1's
5.9 (results/async-decisions-s52). Chained, the level comes from the whole pool, and K < d, slots no request can verify
(one takes at most K), is not priced at all.
"""

from __future__ import annotations

import functools

import numpy as np

from .policies import SPS, quantile_gains, sps_values
from .profile import SpeedProfile


# Pricing at low load runs once per drafted step, right after the model's forwards have flushed numpy's code and
# data from the caches, where its calls cost several times what they cost in a loop of their own
# (scripts/policy_step_cost.py --cold): the async policy's calls took 1.57 % of the time at C = 2, 0.88 % with the
# plain-Python paths below (results/policy-cost-s41). For the few values of one or two requests the same arithmetic
# in plain Python, in the same order (so the same floats), costs a fraction of that.
SMALL = 32  # values per step (R·d) or per depth's candidates (R·deepest) up to which plain Python is used


def depth_survivals(c: np.ndarray) -> np.ndarray:
    """One step's validated confidences [R, d] -> [d, R·d]: row i holds the descending survivals of its first i + 1
    slots (``step_survivals`` of c[:, :i + 1]), zero-padded: what pricing a shallower draft needs of the step."""
    small = small_step_lists(c)
    if small is not None:
        return np.array(small[1])
    a = np.cumprod(c, axis=1)
    if a.shape[0] == 1:  # one request: its survivals already descend along the row
        return np.tril(np.broadcast_to(a[0], (a.size, a.size)))
    out = np.zeros((a.shape[1], a.size))
    for depth in range(1, a.shape[1] + 1):
        out[depth - 1, :a.shape[0] * depth] = -np.sort(-a[:, :depth].ravel())
    return out


def small_step_lists(c: np.ndarray) -> tuple[list[list[float]], list[list[float]]] | None:
    """(survival rows, ``depth_lists``) of a step of at most SMALL values, in plain Python (see SMALL; the running
    products are numpy's cumprod, bit for bit); None for an empty or larger step."""
    if not 0 < c.size <= SMALL:
        return None
    runs = running_products(c.tolist())
    return runs, depth_lists(runs)


def depth_lists(runs: list[list[float]]) -> list[list[float]]:
    """``depth_survivals`` as nested lists, from the step's survival rows (``running_products`` of its [R, d]
    confidences): what the plain-Python pricing reads, so a policy that keeps them lists nothing when it prices."""
    width, depths = sum(map(len, runs)), len(runs[0])
    if len(runs) == 1:  # one request: its survivals already descend along the row
        return [runs[0][:depth] + [0.0] * (width - depth) for depth in range(1, depths + 1)]
    return [sorted((x for row in runs for x in row[:depth]), reverse=True) + [0.0] * (width - len(runs) * depth)
            for depth in range(1, depths + 1)]


def running_products(rows: list[list[float]]) -> list[list[float]]:
    """Each row's running product, multiplied left to right as ``np.cumprod`` does (so the same floats)."""
    out = []
    for row in rows:
        acc, run = 1.0, []
        for x in row:
            acc *= x
            run.append(acc)
        out.append(run)
    return out


def capacity_and_depth(by_depth: list[np.ndarray], rows: list[int], sps: SPS, n_requests: int,
                       tables: list[list[list[float]]] | None = None, margin: float = 0.0) -> tuple[int, int, float]:
    """The best (K, depth) to draft and verify, and its Θ / Θ_0: K from depth..R·depth, depth from 1 to the deepest
    any pooled step drafted (their ``depth_survivals``; ``rows`` their R_old), with drafting at that depth; the
    gains chained over depths (module docstring). (0, 0, 1.0) when no step is pooled.

    The smallest K whose best Θ is within ``margin`` of the best pair's (Θ >= best · (1 - margin)) wins, at its
    best depth (ties: the shallower): a larger K priced within the pricing error is the argmax of noisy
    estimates, not a gain. Depth 1's expected gains are ``pooled_gains`` of every step truncated to 1; depth d's
    are depth d - 1's times the ratio of ``pooled_gains`` of the steps that drafted at least d truncated to d over
    those of the same steps truncated to d - 1 (1 where that is 0), each summed in pool order, so a slow reference
    that pools per depth agrees with it. ``tables``: the same steps as ``depth_lists``, when the caller kept them
    (the plain-Python path then converts nothing)."""
    base = int(n_requests)
    if base <= 0 or not by_depth:
        return 0, 0, 1.0
    deepest = max(m.shape[0] for m in by_depth)
    weight = [0] * deepest  # rows of the pooled steps that drafted at least each depth
    for m, r in zip(by_depth, rows):
        for i in range(m.shape[0]):
            weight[i] += r
    if base * deepest <= SMALL and all(r == base for r in rows):
        k, depth, best = _best_small(tables if tables is not None else [m.tolist() for m in by_depth], weight, base,
                                     _joint_prices(sps, base, deepest, lists=True), margin)
    else:
        k, depth, best = _best(by_depth, rows, weight, base, _joint_prices(sps, base, deepest), margin)
    plain = base * float(_plain_sps(sps, base))
    if plain <= 0:
        return k, depth, (float("inf") if best > 0 else 1.0)
    return k, depth, best / plain


def _best(by_depth, rows, weight, base: int, prices: np.ndarray, margin: float) -> tuple[int, int, float]:
    """(K, depth, Θ) of the chosen pair; steps of other R priced by their quantile curves (see pooled_gains)."""
    deepest = len(weight)
    n = base * deepest
    # gains[i]: the steps that drafted >= i + 1 slots, truncated to i + 1; lower[i]: the same steps truncated to i
    gains, same = np.zeros((deepest, n + 1)), np.zeros((deepest, n))
    lower, lower_same = np.zeros((deepest, n + 1)), np.zeros((deepest, n))
    for m, r in zip(by_depth, rows):
        d = m.shape[0]
        if r == base:
            same[:d, :m.shape[1]] += m
            lower_same[1:d, :m.shape[1]] += m[:d - 1]
            continue
        for i in range(d):  # a step of other R: its top f·K survivals
            curve = quantile_gains(m[i, :r * (i + 1)], r, base, n)
            gains[i] += curve
            if i + 1 < d:
                lower[i + 1] += curve
    gains[:, 1:] += base * np.cumsum(same, axis=1)
    lower[:, 1:] += base * np.cumsum(lower_same, axis=1)
    factors = np.divide(gains, lower, out=np.ones_like(gains), where=lower > 0)  # what slot d multiplies by
    factors[0] = gains[0] / np.maximum(weight[0], 1)
    chained = np.cumprod(factors, axis=0)  # [deepest, n + 1] expected accepted drafts at (depth, K)
    theta = (base + chained) * prices
    theta[:, 0] = -np.inf  # K = 0 is plain decoding, priced by the caller without the drafter
    theta[[w == 0 for w in weight]] = -np.inf  # a depth no pooled step reached (steps of no rows) has no price
    per_k, depth_of = theta.max(axis=0), theta.argmax(axis=0)  # each K's best Θ and depth (ties: the shallower)
    k = int(np.flatnonzero(per_k >= per_k.max() * (1.0 - margin))[0])
    return k, int(depth_of[k]) + 1, float(per_k[k])


def _best_small(tables, weight, base: int, prices: list[list[float]], margin: float) -> tuple[int, int, float]:
    """``_best`` for pools whose steps all have R rows, in plain Python (each step's ``depth_lists``): each depth's
    survivals (and its steps' one slot shallower) summed over the steps in pool order, then the running sums and
    the chain over depths, exactly as ``_best`` computes them, so the floats and ties agree."""
    per_k: dict[int, tuple[float, int]] = {}  # K -> its best (Θ, depth)
    chained: list[float] = []  # the previous depth's expected gains at K = 1, 2, ...
    for i, w in enumerate(weight):
        if w == 0:
            continue
        width = base * (i + 1)
        sums, lows = [0.0] * width, [0.0] * width
        for t in tables:
            if len(t) > i:
                sums = [x + y for x, y in zip(sums, t[i])]  # t[i] is longer only by zero padding
                if i:
                    lows = [x + y for x, y in zip(lows, t[i - 1])]
        flat = chained[-1] if chained else 0.0  # K past the shallower depth's R·d: its gains stay flat
        previous = chained + [flat] * (width - len(chained))
        acc, low, row, chained = 0.0, 0.0, prices[i], []
        for k, (x, y) in enumerate(zip(sums, lows), start=1):
            acc += x
            low += y
            if not i:
                gain = base * acc / w
            else:  # low is 0 only where every survival of those steps is 0, and so is acc
                gain = previous[k - 1] * (base * acc / (base * low) if base * low > 0 else 1.0)
            chained.append(gain)
            theta = (base + gain) * row[k]
            if k not in per_k or theta > per_k[k][0]:  # strictly: ties keep the shallower depth (as argmax does)
                per_k[k] = (theta, i + 1)
    top = max(theta for theta, _ in per_k.values())
    k = min(k for k, (theta, _) in per_k.items() if theta >= top * (1.0 - margin))
    return k, per_k[k][1], per_k[k][0]


def _plain_sps(sps: SPS, base: int) -> float:
    """Steps per second of plain decoding (no drafter) for ``base`` requests."""
    if isinstance(sps, SpeedProfile):
        return _profile_plain_sps(sps, base)
    return float(sps_values(sps, np.array([base]), base)[0])


@functools.lru_cache(maxsize=512)
def _profile_plain_sps(sps: SpeedProfile, base: int) -> float:
    return 1.0 / float(sps.step_s(base, n_requests=base))  # cached: pricing from the grid is ~0.1 ms a call


def _joint_prices(sps: SPS, base: int, deepest: int, lists: bool = False):
    """SPS of a step of ``base`` requests verifying K = 0..base·deepest drafts with d = 1..deepest slots drafted
    -> [deepest, base·deepest + 1]; K > base·d cannot happen at depth d, and K < d wastes slots: both -inf. With
    ``lists``: nested lists whose rows may run past base·deepest + 1 (uncut: the caller reads only K <= base·d)."""
    if not isinstance(sps, SpeedProfile):
        table = _joint_price_table(sps, base, deepest)
        return table.tolist() if lists else table
    # one table per (profile, R) at a depth no drafter here exceeds, cut to size: a new mean context (a new
    # profile view every few dozen steps) then costs one pricing, not one per depth the pool happens to reach
    table, rows = _profile_joint_prices(sps, base, max(deepest, TABLE_DEPTH))
    return rows if lists else table[:deepest, :base * deepest + 1]


TABLE_DEPTH = 8  # depth of the cached price tables (γ = 7 by default)


@functools.lru_cache(maxsize=512)
def _profile_joint_prices(sps: SpeedProfile, base: int, deepest: int) -> tuple[np.ndarray, list[list[float]]]:
    prices = _joint_price_table(sps, base, deepest)
    prices.flags.writeable = False  # shared between calls
    return prices, prices.tolist()


def _joint_price_table(sps: SPS, base: int, deepest: int) -> np.ndarray:
    """The table of ``_joint_prices``, priced in one call: every (depth, K) pair at once."""
    n = base * deepest
    depth = np.repeat(np.arange(1, deepest + 1), n + 1)  # [deepest·(n + 1)], depth-major
    k = np.tile(np.arange(n + 1), deepest)
    prices = sps_values(sps, base + k, base, depth).reshape(deepest, n + 1)
    # K > R·d drafts cannot hold; K < d drafts slots no request can verify (one takes at most K): both unpriced
    prices[((k > base * depth) | (k < depth)).reshape(deepest, n + 1)] = -np.inf
    return prices
