"""Verification-length policies: from calibrated per-slot confidences to how many drafts each request verifies.

Shapes: ``c`` is [R, γ] float64 in [0, 1] (c[r, j] = calibrated P(slot j accepted | slots < j accepted), 0-based
j); every policy returns ``lengths`` [R] int64 in 0..γ (ℓ_r: verify drafts 1..ℓ_r of request r).

Exactness rule every policy here obeys (DESIGN.md invariant 3): whether slot j is verified may depend only on what
was known before slot j's token was sampled. c[r, j] depends on the token at slot j-1, so that rule means: the
decision about slot j may look at c[r, :j+1] (and at other requests), never at c[r, j+1:]. Each function says why
it complies; ``sync_prefix_schedule(..., unsafe=True)`` is the one that does not, kept for the counterexample test.

Visit order (shared by the sync and async schedulers): descending survival a[r, j], ties by smaller j, then smaller
r. Because a is non-increasing along j (c <= 1 and rounding is monotone), this order always visits (r, j) after
(r, j-1), so any prefix of the order admits a prefix of each request's drafts.

SPS may be a ``SpeedProfile`` (then the drafting cost of the R running requests is included) or any callable
B -> steps per second; callables are tried on a whole int array first and called per element if that fails.
"""

from __future__ import annotations

import functools
import time
from typing import Callable, Union

import numpy as np

from .profile import SpeedProfile

SPS = Union[SpeedProfile, Callable[[object], object]]
CONTEXT_STEP = 32  # tokens: the mean context a step is priced at is rounded to a multiple of this (fewer re-pricings)


def rounded_context(context: float | None) -> int:
    """The running requests' mean context as the schedulers price it: a multiple of CONTEXT_STEP (0: not given)."""
    return 0 if not context else max(CONTEXT_STEP, CONTEXT_STEP * round(context / CONTEXT_STEP))


SMALL_CHECK = 32  # values up to which as_confidences checks the range in plain Python


def as_confidences(c) -> np.ndarray:
    """Validate and convert (numpy, list, or torch tensor) to float64 [R, γ] in [0, 1]."""
    if hasattr(c, "detach"):  # torch tensor, without importing torch here
        c = c.detach().to("cpu").double().numpy()
    c = np.asarray(c, dtype=np.float64)
    if c.ndim != 2:
        raise ValueError(f"confidences must have shape [R, gamma], got shape {c.shape}")
    # a step's few values are checked in plain Python: two numpy reductions, run cold right after the model's
    # forwards, cost the async policy ~70 µs a step at one request (session 44); NaN fails either comparison
    if c.size <= SMALL_CHECK:
        ok = all(0.0 <= x <= 1.0 for x in c.ravel().tolist())
    else:
        ok = c.min() >= 0.0 and c.max() <= 1.0
    if c.size and not ok:
        raise ValueError("confidences must lie in [0, 1] (calibrated probabilities); got values outside or NaN")
    return c


def survival(c) -> np.ndarray:
    """a[r, j] = prod_{i <= j} c[r, i]: estimated probability that drafts 1..j+1 of request r are all accepted."""
    return np.cumprod(as_confidences(c), axis=1)


def _visit_order(a: np.ndarray) -> np.ndarray:
    """Flat indices (j * R + r) of a [R, γ] in visit order; a stable sort of the j-major flattening gives the
    tie-break (smaller j, then smaller r) for free."""
    return np.argsort(-a.T.ravel(), kind="stable")


def sps_values(sps: SPS, n_tokens: np.ndarray, n_requests: int, depth: np.ndarray | None = None) -> np.ndarray:
    """SPS at each B of ``n_tokens`` [n] -> float64 [n]; a SpeedProfile prices drafting ``depth`` [n] slots
    (None: the full block)."""
    if isinstance(sps, SpeedProfile):
        return np.asarray(sps.sps(n_tokens, n_requests=n_requests, depth=depth), dtype=np.float64)
    try:
        out = np.asarray(sps(n_tokens), dtype=np.float64)
        if out.shape == n_tokens.shape:
            return out
        if out.ndim == 0:  # a constant SPS answered for the whole array at once
            return np.full(n_tokens.shape, float(out))
    except Exception:  # e.g. `if B < 128:` on an array; fall back to scalar calls
        pass
    return np.array([float(sps(int(b))) for b in n_tokens], dtype=np.float64)


def _theta(a_sorted: np.ndarray, base: int, sps: SPS, depth: np.ndarray | None = None) -> np.ndarray:
    """Θ_n = τ_n · SPS(base + n) for n = 0..N, τ_n = base + sum of the first n sorted survivals -> [N + 1].
    The cumsum includes ``base`` as its first term so τ is summed in exactly the order a scalar loop would."""
    return _tau(a_sorted, base) * sps_values(sps, base + np.arange(a_sorted.size + 1), base, depth)


def _tau(a_sorted: np.ndarray, base: int) -> np.ndarray:
    """τ_n = base + sum of the first n sorted survivals, n = 0..N -> [N + 1], summed in a scalar loop's order."""
    return np.cumsum(np.concatenate(([float(base)], a_sorted)))


def draft_depth_for(capacity: int, gamma: int) -> int:
    """Slots to draft when at most ``capacity`` drafts will be verified: one request can take at most K of them
    (admissions are prefixes), plus one more slot whose confidence lets the next K grow (the history only
    holds the slots drafted)."""
    return max(1, min(int(gamma), int(capacity) + 1))


def _lengths(order: np.ndarray, n_admitted: int, n_requests: int) -> np.ndarray:
    taken = order[:n_admitted]
    r, j = taken % n_requests, taken // n_requests
    lengths = np.bincount(r, minlength=n_requests)
    # Prefix check: ℓ distinct slots of one request sum to ℓ(ℓ-1)/2 only if they are exactly 0..ℓ-1.
    if not np.array_equal(np.bincount(r, weights=j, minlength=n_requests), lengths * (lengths - 1) / 2):
        raise RuntimeError("scheduler admitted a non-prefix set of slots; survival must be non-increasing along j")
    return lengths.astype(np.int64)


def sync_prefix_schedule(c, sps: SPS, *, unsafe: bool = False, capacity: int | None = None,
                         depth: int | None = None) -> np.ndarray:
    """Paper Algorithm 1: greedy admission in visit order while Θ = τ·SPS(B) strictly improves; stop at the first
    item that does not improve. [R, γ] -> [R].

    Why lossless: slot j of request r is admitted iff no item visited before it failed to improve Θ and it
    improves Θ itself. Items visited before it are other requests' slots and this request's slots < j, so
    the decision never looks at c[r, j+1:], i.e. at tokens sampled at slot j or later.

    ``capacity`` K (the async scheduler's, fixed before drafting) also stops admission after K items: slot j is
    then admitted iff fewer than K items precede it as well, which reads the same items, so it stays lossless.
    Drafting is priced at ``depth``, the slots drafted (None: the full block); it is the same for every prefix,
    the cost of a step already drafting, so only the verify cost decides.

    ``unsafe=True`` drops the early stop (admit the argmax-Θ prefix of the whole order): admitting slot j may then
    hinge on c[r, j+1], a function of slot j's own token, and the output distribution is biased.
    """
    c = as_confidences(c)
    n_req = c.shape[0]
    if c.size == 0:
        return np.zeros(n_req, dtype=np.int64)
    a = np.cumprod(c, axis=1)
    order = _visit_order(a)
    if isinstance(sps, SpeedProfile):  # immutable: its prices for (R, N, depth) are computed once
        theta = _tau(a.T.ravel()[order], n_req) * _prefix_prices(sps, n_req, order.size, depth)
    else:
        depths = None if depth is None else np.full(order.size + 1, int(depth))
        theta = _theta(a.T.ravel()[order], n_req, sps, depths)
    if unsafe:
        n_admitted = int(np.argmax(theta))  # first maximum: the shortest best prefix
    else:
        # Every kept item improved Θ, so Θ_best before item n is Θ_{n-1}: stop at the first n with Θ_n <= Θ_{n-1}.
        stop = theta[1:] <= theta[:-1]
        n_admitted = int(np.argmax(stop)) if stop.any() else order.size
    if capacity is not None:
        n_admitted = min(n_admitted, int(capacity))
    return _lengths(order, n_admitted, n_req)


def sync_prefix_schedule_unsafe_no_early_stop(c, sps: SPS) -> np.ndarray:
    """NOT LOSSLESS — global search without the early stop; exists only to demonstrate the bias in tests."""
    return sync_prefix_schedule(c, sps, unsafe=True)


def _pool(c_old, n_requests: int | None) -> tuple[list[np.ndarray], int, int]:
    """(steps' confidences, current R, pooled rows P) from one [R_old, γ] array or a list of them."""
    steps = [as_confidences(c) for c in (c_old if isinstance(c_old, (list, tuple)) else [c_old])]
    if not steps:
        raise ValueError("async_capacity needs at least one step's confidences")
    base = steps[0].shape[0] if n_requests is None else int(n_requests)
    return steps, base, sum(c.shape[0] for c in steps)


def step_survivals(c: np.ndarray) -> np.ndarray:
    """One step's validated confidences [R, γ] -> its survivals, descending [R·γ] (what pricing K needs of it)."""
    return -np.sort(-np.cumprod(c, axis=1).ravel())


def pooled_gains(c_old, *, n_requests: int | None = None) -> np.ndarray:
    """Expected accepted drafts this step if the n best current slots are verified, n = 0..R·γ -> [R·γ + 1], from
    earlier steps' confidences (one [R_old, γ] array or a list of them): the mean of each step's own curve
    (weighted by its rows), a step of R_old rows priced for R requests as the quantile curve 1/f of its top f·n
    survivals, f = R_old / R. With one step and R = R_old it is the cumulative sum of the sorted survivals.

    Why per step and not one quantile curve over all pooled rows: a request's drafts are a prefix of *its* row,
    so the best slots of R requests are the best of R rows, not the best of the whole pool. At R = 1 with 8 pooled
    rows the single curve took the top 8 of 56 survivals (the best rows' slots 1 and 2) as "slot 1", which
    over-promised exactly where K > 0 was chosen (26.6 % of such drafts accepted where the estimate said ≥ 41 %).
    """
    steps, base, pooled = _pool(c_old, n_requests)
    return _gains([step_survivals(c) for c in steps], [c.shape for c in steps], base, pooled)


def _gains(survivals: list[np.ndarray], shapes: list[tuple[int, int]], base: int, pooled: int) -> np.ndarray:
    """``pooled_gains`` from each step's descending survivals [R_old·γ] (``step_survivals``) and shape (R_old, γ)."""
    if base <= 0 or pooled == 0:
        return np.zeros(1)
    n_cand = base * max(g for _, g in shapes)  # steps drafted shallower say nothing of deeper slots: flat
    total = np.zeros(n_cand + 1)
    # Steps of R_old = R rows need no quantile scaling, and a cumulative sum is linear: add their survivals
    # (a shallower step's missing slots add nothing, which is its flat curve) and sum once. At R = 1 every pooled
    # step is such a step, and one cumsum per step was most of the scheduler's time per drafted step.
    same = np.zeros(n_cand)
    for a, (rows, _) in zip(survivals, shapes):
        if rows == 0:
            continue
        if rows == base:
            same[:a.size] += a
            continue
        total += quantile_gains(a, rows, base, n_cand)
    total[1:] += base * np.cumsum(same)
    return total / pooled


def quantile_gains(a: np.ndarray, rows: int, base: int, n_cand: int) -> np.ndarray:
    """One step of R_old = ``rows`` rows priced for R = ``base`` requests, weighted by its rows: its descending
    survivals ``a`` as the quantile curve of its top f·n, f = R_old / R, n = 0..n_cand -> [n_cand + 1]."""
    cum = np.concatenate(([0.0], np.cumsum(a)))
    f = rows / base
    return rows * np.interp(f * np.arange(n_cand + 1), np.arange(cum.size), cum) / f


def async_capacity(c_old, sps: SPS, *, n_requests: int | None = None, min_gain: float = 0.0) -> int:
    """Capacity K from earlier steps' confidences: the best K of ``best_capacity`` if it beats plain decoding
    (K = 0) by more than ``min_gain`` — a margin for the profile's own error, so near-ties do not pay for the
    drafter on a guess — else 0."""
    best, ratio = best_capacity(c_old, sps, n_requests=n_requests)
    return best if ratio > 1.0 + min_gain else 0


def best_capacity(c_old, sps: SPS, *, n_requests: int | None = None) -> tuple[int, float]:
    """Capacity K (total drafts to admit) from confidences of earlier steps: argmax over all prefixes of the
    sorted survivals of Θ over K >= 1 (no early stop, so a jagged SPS curve cannot trap the search at a local
    maximum), and Θ_K / Θ_0, its predicted throughput over plain decoding (below 1 when drafting does not pay).

    ``c_old`` is one earlier step's confidences [R_old, γ] or a list of several steps' (pooled: below). Lossless
    because K is computed before the current step's tokens exist. ``n_requests`` (the current R, known before
    drafting) sets the base of τ and B; default: the first array's R_old.

    Pooling (``pooled_gains``): the expected top-K survival sum of R requests is the mean over the pooled steps of
    each step's top-K curve priced for R requests. With one array and R = R_old this is exactly the top-K sum. At
    low load one request's confidences from one step are a noisy sample (at R = 1 the choice between drafting and
    not flips with every hard token); pooling a few steps' worth makes K follow the text's difficulty instead.

    Because K is known *before* drafting, the drafter need only draft ``draft_depth_for(K)`` slots, and a profile
    with a depth-1 drafting table prices each K at that depth. K = 0 means the drafter need not run at all. So
    with a SpeedProfile the K = 0 candidate is scored without the drafting cost (plain decoding), and K = 0 tells
    the engine to skip the drafter: at high load this is what keeps the scheduler at or above plain decoding when
    drafting is not free.
    """
    steps, base, _ = _pool(c_old, n_requests)
    return capacity_from_survivals([step_survivals(c) for c in steps], [c.shape for c in steps], sps, base)


def capacity_from_survivals(survivals: list[np.ndarray], shapes: list[tuple[int, int]], sps: SPS,
                            n_requests: int) -> tuple[int, float]:
    """``best_capacity`` on steps already reduced to their descending survivals [R_old·γ] (``step_survivals``)
    and shapes (R_old, γ). The async scheduler keeps these per drafted step: at R = 1 it re-prices K on every
    drafted step from 8 pooled steps, and validating, multiplying and sorting each of them again took most of the
    ~0.14 ms its ``prepare`` spent per step."""
    base, pooled = int(n_requests), sum(rows for rows, _ in shapes)
    if not shapes:
        raise ValueError("async_capacity needs at least one step's confidences")
    if base <= 0 or pooled == 0:
        return 0, 1.0
    n_cand = base * max(g for _, g in shapes)  # drafting priced at draft_depth_for(K) (capped at γ)
    prices, plain_s = _capacity_prices(sps, base, n_cand)
    if len(shapes) == 1 and pooled == base:  # τ summed in the order a scalar loop would (exact reference tests)
        theta = _tau(survivals[0], base) * prices
    else:
        theta = (base + _gains(survivals, shapes, base, pooled)) * prices
    if plain_s is not None:
        theta[0] = base / plain_s
    if theta.size == 1:
        return 0, 1.0
    best = 1 + int(np.argmax(theta[1:]))
    if theta[0] <= 0:  # a callable SPS may price plain decoding at zero: any drafting beats it
        return best, (float("inf") if theta[best] > 0 else 1.0)
    return best, float(theta[best] / theta[0])


def could_grow(survivals: list[np.ndarray], shapes: list[tuple[int, int]], sps: SPS, n_requests: int,
               capacity: int) -> bool:
    """Whether K + 1 drafts could beat K if the next draft were as likely to be accepted as the K-th, the best it
    can be (pooled survivals are sorted): the extra slot ``draft_depth_for`` drafts exists only so that K can grow,
    and where even this bound says it cannot, that slot is drafting time spent on nothing. Same inputs as
    ``capacity_from_survivals``; ``capacity`` >= 1."""
    base, pooled = int(n_requests), sum(rows for rows, _ in shapes)
    gains = _gains(survivals, shapes, base, pooled)  # [n_cand + 1]
    k = int(capacity)
    if not 1 <= k < gains.size:
        raise ValueError(f"capacity must lie in 1..{gains.size - 1}, got {capacity}")
    prices, _ = _capacity_prices(sps, base, k + 1)
    bound = gains[k] + (gains[k] - gains[k - 1])
    return bool((base + bound) * prices[k + 1] > (base + gains[k]) * prices[k])


def _capacity_prices(sps: SPS, base: int, n_cand: int) -> tuple[np.ndarray, float | None]:
    """SPS of a step of ``base`` requests verifying K = 0..n_cand drafts, drafting priced at depth K + 1 ->
    ([n_cand + 1], and for a SpeedProfile the seconds of a plain step, which K = 0 is scored by instead).
    A SpeedProfile is immutable, so its prices are computed once per (R, n_cand): re-pricing from the grid took
    ~0.2 ms of the ~0.27 ms the async scheduler spent per drafting step at R = 1 (1.5 % of a step)."""
    if isinstance(sps, SpeedProfile):
        return _profile_prices(sps, base, n_cand)
    return sps_values(sps, base + np.arange(n_cand + 1), base, 1 + np.arange(n_cand + 1)), None


@functools.lru_cache(maxsize=512)
def _profile_prices(sps: SpeedProfile, base: int, n_cand: int) -> tuple[np.ndarray, float]:
    prices = sps_values(sps, base + np.arange(n_cand + 1), base, 1 + np.arange(n_cand + 1))
    prices.flags.writeable = False  # shared between calls
    return prices, float(sps.step_s(base, n_requests=base))


@functools.lru_cache(maxsize=512)
def _prefix_prices(sps: SpeedProfile, base: int, n_items: int, depth: int | None) -> np.ndarray:
    """SPS of a step of ``base`` requests verifying 0..n_items drafts, drafting ``depth`` slots (None: the block)
    -> [n_items + 1]: Algorithm 1's prices, the same for every step of that shape (pricing them from the grid was
    most of a probe's ~0.4 ms in the engine)."""
    depths = None if depth is None else np.full(n_items + 1, int(depth))
    prices = sps_values(sps, base + np.arange(n_items + 1), base, depths)
    prices.flags.writeable = False  # shared between calls
    return prices


def async_schedule(c_now, capacity: int) -> np.ndarray:
    """Admit the ``capacity`` current candidates of highest survival (visit order) [R, γ] -> [R].

    Lossless: slot j of request r is admitted iff fewer than K items precede it in visit order; those are other
    requests' slots and this request's slots < j, so c[r, j+1:] plays no part.
    """
    return top_k_lengths(as_confidences(c_now), capacity)


def top_k_lengths(c_now: np.ndarray, capacity: int, runs: list[list[float]] | None = None) -> np.ndarray:
    """``async_schedule`` on confidences already validated by ``as_confidences`` (the async policy's select has
    done so: validating twice was a fifth of its time per step). ``runs``: their running products as lists
    (``depth_pricing.running_products``, numpy's cumprod bit for bit), when the caller has them."""
    n_req = c_now.shape[0]
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0, got {capacity}")
    if c_now.size == 0:
        return np.zeros(n_req, dtype=np.int64)
    if n_req == 1:  # one request's best K slots are its first K (survival never rises along a row)
        return np.array([min(int(capacity), c_now.shape[1])], dtype=np.int64)
    if n_req * min(int(capacity), c_now.size) <= SMALL_MERGE:
        rows = runs if runs is not None else np.cumprod(c_now, axis=1).tolist()
        return np.array(_merged_lengths(rows, int(capacity)), dtype=np.int64)
    order = _visit_order(np.cumprod(c_now, axis=1))
    return _lengths(order, min(int(capacity), order.size), n_req)


SMALL_MERGE = 32  # R·K at most this: top-K by merging the rows in Python (a few µs) rather than a full sort


def _merged_lengths(rows: list[list[float]], capacity: int) -> list[int]:
    """Top-K in visit order over rows whose survivals never rise along a row: K times, take the best next slot of
    any row, ties to the smaller slot index j, then the smaller request r, which is the visit order's tie-break
    (``_visit_order``); a row's slots come out in order, so the taken set is a prefix of each row."""
    lengths, width = [0] * len(rows), len(rows[0])
    for _ in range(min(capacity, width * len(rows))):
        best, best_v, best_j = -1, -1.0, width
        for r, row in enumerate(rows):
            j = lengths[r]
            if j < width and (row[j] > best_v or (row[j] == best_v and j < best_j)):
                best, best_v, best_j = r, row[j], j
        lengths[best] += 1
    return lengths


def fixed_k(n_requests: int, gamma: int, k: int) -> np.ndarray:
    """Every request verifies min(k, γ) drafts: k = 0 is plain decoding, k = 1 is 'MTP-1'. Trivially lossless."""
    if k < 0 or n_requests < 0 or gamma < 0:
        raise ValueError(f"need k, n_requests, gamma >= 0, got {k}, {n_requests}, {gamma}")
    return np.full(n_requests, min(k, gamma), dtype=np.int64)


def static_threshold(c, threshold: float, *, cumulative: bool = False) -> np.ndarray:
    """ℓ_r = number of leading slots whose *per-slot* confidence c[r, j] >= threshold (the paper's Figure 5
    baseline); with ``cumulative=True`` the survival a[r, j] is thresholded instead. [R, γ] -> [R].

    Lossless either way: slot j is kept iff slots 0..j all pass, which reads only c[r, :j+1].
    """
    x = survival(c) if cumulative else as_confidences(c)
    return np.cumprod(x >= threshold, axis=1).sum(axis=1).astype(np.int64)


def _skipped_step(pol, n_requests: int, gamma: int) -> None:
    """One step of an async policy whose history says K = 0 (all-zero confidences): the common step under load."""
    zeros = np.zeros((n_requests, gamma))
    if pol.prepare(n_requests):  # the first steps and the probes draft
        pol.select(zeros)
    else:
        pol.select(None, n_requests=n_requests)


def bench_policy_latency(n_requests: int = 256, gamma: int = 7, repeats: int = 200, seed: int = 0) -> dict[str, float]:
    """Median decision time (microseconds) of each scheduler on random confidences; prints and returns them.

    Not a timed test (CI machines are too noisy for that); run it by hand: the target is < 1000 µs for 256 x 7.
    """
    from .async_policy import AsyncPolicy  # local imports: both modules import this one
    from .simulator import gpu_like_profile

    rng = np.random.default_rng(seed)
    prof = gpu_like_profile()
    cs = [rng.beta(4.0, 1.0, size=(n_requests, gamma)) for _ in range(repeats)]
    cases = {
        "sync (Alg. 1, early stop)": lambda c: sync_prefix_schedule(c, prof),
        "async capacity K": lambda c: async_capacity(c, prof),
        "async top-K": lambda c: async_schedule(c, 3 * n_requests),
        "static threshold": lambda c: static_threshold(c, 0.7),
        "AsyncPolicy prepare+select": lambda c, pol=AsyncPolicy(prof): (pol.prepare(n_requests), pol.select(c)),
        "AsyncPolicy, drafter skipped": lambda c, pol=AsyncPolicy(prof): _skipped_step(pol, n_requests, gamma),
    }
    out = {}
    for name, fn in cases.items():
        fn(cs[0])  # warm-up: first calls pay for imports/allocations
        times = []
        for c in cs:
            t0 = time.perf_counter()
            fn(c)
            times.append(time.perf_counter() - t0)
        out[name] = float(np.median(times) * 1e6)
        print(f"{name:28s} {n_requests}x{gamma}: median {out[name]:8.1f} us")
    return out
