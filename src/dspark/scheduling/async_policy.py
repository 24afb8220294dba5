"""The asynchronous DSpark scheduler: verification capacity K from old confidences, top-K of the current ones."""

from __future__ import annotations

from collections import deque

import numpy as np

from .acceptance_tracker import AcceptanceTracker
from .live_profile import LiveProfile
from .long_run import LongRunSurvivals
from .depth_pricing import capacity_and_depth, depth_survivals, small_step_lists
from .policies import (SPS, capacity_from_survivals, could_grow, draft_depth_for, rounded_context, step_survivals,
                       sync_prefix_schedule, top_k_lengths)
from .policy_objects import need_confidences


DIP_STEPS = 4  # hold_backoff: drafting this many steps in a row at a lower load is a load drop, not a dip


def _flag(name: str, value) -> bool:
    if value not in (0, 1):  # also spelled async:name=1
        raise ValueError(f"{name} must be a bool (0 or 1), got {value!r}")
    return bool(value)


class AsyncPolicy:
    """Asynchronous scheduler: K from the confidences of a step at least ``lag`` steps old, then top-K of the
    current ones.

    A production engine computes K for step t while step t-1 runs, from the last confidences it has, which are
    step t-2's — hence lag 2. Call ``prepare(R)`` before drafting: it computes K and returns False when K = 0,
    i.e. the drafter can be skipped this step. K is known before drafting, so only the slots K can use are
    drafted (``draft_depth``). Skipped steps produce no confidences, so after ``probe_every`` skipped steps in a
    row a probe drafts ``probe_requests`` requests anyway and verifies them by Algorithm 1 on their own
    confidences; each probe that still prices K = 0 doubles the interval up to ``max_probe_every``. For the
    first steps, with no history old enough, it falls back to Algorithm 1, which is lossless on its own.

    Every rule below reads only old confidences, counts of past decisions, request counts or past step times,
    never the current tokens, so all stay lossless. Why each exists and what it measured on the dev CPU:
    docs/async-scheduler.md.

    - ``min_gain`` (3 %): K > 0 only when it beats plain decoding by more than the profile's pricing error;
      ``stay_gain`` (0): once drafting, keep on while the best K beats plain decoding at all (hysteresis);
      ``low_stay_gain`` (-3 %): the same at R <= ``joint_requests``, where a pool is a few steps and the pools
      priced below plain decoding accepted more than they promised, so a run ends only on a clear loss (None:
      ``stay_gain``).
    - ``pool_requests`` / ``pool_steps`` / ``max_age``: K pools the newest old-enough steps until they hold 8
      rows (at R = 1 the last 8 drafted steps), none older than 16 steps unless it is the newest.
    - ``probe_requests`` (2), ``reprobe_every`` (2), ``near_loss`` (5 %): a probe that drafts every running
      request is an ordinary drafting step, so at such loads probes come soon after a drafting run ends and keep
      coming while the best K is priced near plain decoding.
    - ``spread_depth`` (on): the drafted depth is capped by how K was shared in the pooled steps.
    - ``joint_requests`` (4; 2 before session 46), ``explore_every`` (8): at low load K and the drafted depth are
      priced together (``depth_pricing.capacity_and_depth``); every 8th drafting step drafts one slot more, so
      deeper depths keep a price; ``shallow_probes`` (on): a probe there drafts one slot past the depth last
      priced, not the whole block (at C = 1 on the AVX2 EPYC a probe drafted 7 slots for Algorithm 1 to verify
      1.2-1.4: results/async-decisions-s51/c1-t1.txt, -s52/c1-t1-before.txt); ``k_margin`` (0: off): there the
      smallest K priced within that share of the best K's Θ wins (the best of noisy estimates is biased up; 2 %
      measured within the noise of 0 at C = 1 / 2 on the AVX2 EPYC: results/serving-s52-amd-avx2-k-margin-t1).
      Above it K is priced at depth K + 1, which at C = 4 and T = 0 on the Intel Xeon charged drafting so much
      that the policy skipped 77 % of the steps while fixed-2 gained 8 %.
    - ``price_context`` (on): steps are priced at the running requests' mean context.
    - ``shrink`` (1: off), ``long_steps`` (256): at R <= ``joint_requests`` each pooled step's survivals are moved
      toward their mean over the last ``long_steps`` drafted steps, mean + shrink · (pool - mean)
      (``long_run.py``): at one request a pool of eight steps predicts the next one little (no throughput gain
      measured, so off).
    - Off by default: ``early_stop`` (Algorithm 1 capped at K), ``lean_depth`` (no extra slot unless K + 1
      could pay), ``online_calibration`` (policy ``async-online``: confidences scaled by accepted / predicted so
      far, ``acceptance_tracker.py``), ``steady_run`` (false starts under load),
      ``far_loss`` / ``far_probe_every`` (probes back off further where drafting is far from paying), ``live``
      (prices follow the measured step times, ``live_profile.py``; with ``live_overhead``, on by default, a
      forward's time includes its commit and drafting's the feed of deferred states).
    - ``confirm`` (on since session 47): under load a promising pool thinner than the batch (a probe's two rows
      pricing K for 16 requests) is probed again before every request drafts: on the Intel Xeon at C = 16 it was
      never below the line without it in 8 paired repeats (T = 0 / 1: 1.001 / 1.012 median), and removed a repeat
      at 0.937 of plain decoding; at C = 4 / 8 0.992-1.018 (results/serving-s47-c16-confirm-t0, -t1,
      results/serving-s47-confirm-c4-c8-t0, -t1).
    - ``watch_load`` (on): once the batch holds at most half the requests it held when the probes began backing
      off, the next probe comes after ``probe_every`` skipped steps (off: only past ``max_probe_every``).
    - ``hold_backoff`` (on since session 53): drafting at fewer requests than the last probe priced (one request
      between two at C = 2) keeps the probes' interval unless it lasts ``DIP_STEPS`` steps; such dips restarted
      the back-off every request: 11 % of the steps at C = 2 on a bf16 target were probes costing 70 % of a step
      each (results/async-decisions-s53/c2-bf16-t1.txt, results/serving-s53-amd-avx2-bf16-hold-t1).
    """

    needs_confidence = True
    drafts = True
    load_dependent = True  # K comes from the batch's confidences and the price of a step at its size

    def __init__(self, sps: SPS, lag: int = 2, probe_every: int = 8, max_probe_every: int = 64,
                 pool_requests: int = 8, pool_steps: int = 8, online_calibration: bool = False,
                 min_gain: float = 0.03, probe_requests: int = 2, stay_gain: float | None = 0.0,
                 reprobe_every: int | None = None, max_age: int | None = 16, near_loss: float = 0.05,
                 early_stop: bool = False, lean_depth: bool = False, live: bool = False, steady_run: int = 1,
                 confirm: bool = True, far_loss: float = 0.1, far_probe_every: int | None = None,
                 price_context: bool = True, spread_depth: bool = True, joint_requests: int = 4,
                 explore_every: int = 8, watch_load: bool = True, live_overhead: bool = True,
                 shrink: float = 1.0, long_steps: int = 256, low_stay_gain: float | None = -0.03,
                 shallow_probes: bool = True, k_margin: float = 0.0, hold_backoff: bool = True):
        if lag < 1:
            raise ValueError(f"lag must be >= 1 (lag 0 would read the current tokens), got {lag}")
        if not 1 <= probe_every <= max_probe_every:
            raise ValueError(f"need 1 <= probe_every <= max_probe_every, got {probe_every}, {max_probe_every}")
        if not 0.0 <= min_gain < 1.0:
            raise ValueError(f"min_gain must lie in [0, 1), got {min_gain}")
        stay_gain = min_gain if stay_gain is None else stay_gain  # None: no hysteresis
        if not -1.0 < stay_gain <= min_gain:
            raise ValueError(f"stay_gain must lie in (-1, min_gain = {min_gain}], got {stay_gain}")
        low_stay_gain = stay_gain if low_stay_gain is None else low_stay_gain
        if not -1.0 < low_stay_gain <= min_gain:
            raise ValueError(f"low_stay_gain must lie in (-1, min_gain = {min_gain}], got {low_stay_gain}")
        reprobe_every = min(2, max_probe_every) if reprobe_every is None else reprobe_every
        if not 1 <= reprobe_every <= max_probe_every:
            raise ValueError(f"need 1 <= reprobe_every <= max_probe_every, got {reprobe_every}, {max_probe_every}")
        if min(pool_requests, pool_steps, probe_requests) < 1:
            raise ValueError(f"pool_requests, pool_steps and probe_requests must be >= 1, got {pool_requests}, "
                             f"{pool_steps}, {probe_requests}")
        self._sps, self.lag = sps, lag
        self.probe_every, self.max_probe_every = probe_every, max_probe_every
        self.pool_requests, self.pool_steps = pool_requests, pool_steps
        self.min_gain, self.probe_requests = min_gain, probe_requests
        self.stay_gain, self.low_stay_gain, self.reprobe_every = stay_gain, low_stay_gain, reprobe_every
        if max_age is not None and max_age < lag:
            raise ValueError(f"max_age must be >= lag = {lag} (None: no limit), got {max_age}")
        self.max_age = max_age
        if not 0.0 <= near_loss < 1.0:
            raise ValueError(f"near_loss must lie in [0, 1), got {near_loss}")
        self.near_loss = near_loss
        self.early_stop = _flag("early_stop", early_stop)
        self.lean_depth = _flag("lean_depth", lean_depth)
        live = _flag("live", live)
        if steady_run < 1:
            raise ValueError(f"steady_run must be >= 1, got {steady_run}")
        self.steady_run = steady_run
        self.confirm = _flag("confirm", confirm)
        if not 0.0 < far_loss < 1.0:
            raise ValueError(f"far_loss must lie in (0, 1), got {far_loss}")
        far_probe_every = max_probe_every if far_probe_every is None else far_probe_every  # None: no far back-off
        if far_probe_every < max_probe_every:
            raise ValueError(f"need far_probe_every >= max_probe_every = {max_probe_every}, got {far_probe_every}")
        self.far_loss, self.far_probe_every = far_loss, far_probe_every
        self.watch_load, self.hold_backoff = _flag("watch_load", watch_load), _flag("hold_backoff", hold_backoff)
        self.prices_context = _flag("price_context", price_context)  # prepare() takes the mean context (``sps``)
        self.spread_depth = _flag("spread_depth", spread_depth)
        self.shallow_probes = _flag("shallow_probes", shallow_probes)
        if not 0.0 <= k_margin < 1.0:
            raise ValueError(f"k_margin must lie in [0, 1), got {k_margin}")
        self.k_margin = float(k_margin)
        if joint_requests < 0:
            raise ValueError(f"joint_requests must be >= 0 (0: never), got {joint_requests}")
        if explore_every < 1:
            raise ValueError(f"explore_every must be >= 1, got {explore_every}")
        self.joint_requests, self.explore_every = int(joint_requests), explore_every
        if not 0.0 <= shrink <= 1.0:
            raise ValueError(f"shrink must lie in [0, 1] (1: the pools as they are), got {shrink}")
        if long_steps < 1:
            raise ValueError(f"long_steps must be >= 1, got {long_steps}")
        self.shrink = float(shrink)
        self._long = LongRunSurvivals(int(long_steps), lag) if shrink < 1.0 else None
        self.live = LiveProfile(sps) if live else None  # kept across reset(): it describes the machine
        self.live_overhead = _flag("live_overhead", live_overhead)
        self.tracker = AcceptanceTracker() if online_calibration else None
        self.name = "async-online" if online_calibration else "async"
        self.reset()

    @property
    def sps(self) -> SPS:
        """The prices K is chosen by: the cached profile, or its live correction, at the running requests' mean
        context (rounded to ``CONTEXT_STEP`` tokens, so that K is re-priced every few dozen steps, not every step)
        when the profile prices context: verifying a draft costs more the longer the context it attends to."""
        base = self._sps if self.live is None else self.live.current
        return base.at_context(self._context) if self._context and hasattr(base, "at_context") else base

    def reset(self) -> None:
        # (step, confidences, their sorted survivals, those at each depth (joint_requests)) of the last drafted steps:
        # enough to pool `pool_steps` of them `lag` steps back; the survivals are kept so re-pricing K does not redo
        # them for every pooled step
        self._history: deque[tuple] = deque(maxlen=self.lag + self.pool_steps)
        self._lists: dict[int, list] = {}  # step -> its depth_lists, for the history's small steps (see select)
        self._step = 0  # index of the step being planned
        self._skipped = 0  # drafter-skipped steps in a row
        self._interval = self.probe_every  # skipped steps before the next probe
        self._run = 0  # K > 0 steps in a row
        self._backoff_load = 0  # requests in the batch when probes began backing off (watch_load; 0: they have not)
        self._probe_load = 0  # requests in the batch the last probe's interval was set for (hold_backoff)
        self._confirmed: tuple = ()  # the thin pool the last confirming probe was run for
        self._planned = False
        self._context = 0  # the running requests' mean context, rounded (0: not given)
        self._probing = False  # this step is a probe (drafts only `probe_requests` requests)
        # (pool steps, R, tracker ratio), the best K they priced, Θ_K / Θ_0, whether K + 1 could pay (lean_depth),
        # the longest prefix one request took of that K in the pooled steps (spread_depth; None: not limited)
        # and the depth to draft (joint_requests; 0: K + 1)
        self._memo: tuple = (None, 0, 1.0, True, None, 0)
        self._depth = 0  # see joint_requests
        self._explore = False  # this step drafts one slot past the priced depth (joint_requests)
        self._drafting_steps = 0  # K > 0 steps so far (joint_requests explores on every explore_every-th)
        self._grow = True  # draft the extra slot (see lean_depth)
        self._spread: int | None = None  # see spread_depth
        self.last_capacity: int | None = None  # K of the current/last step (None: Algorithm 1)
        self.last_ratio: float | None = None  # Θ_K / Θ_0 of the best K its pool priced (None: no pool)
        if self.tracker is not None:
            self.tracker.reset()
        if self._long is not None:
            self._long.reset()

    def _old_confidences(self) -> tuple[tuple[int, ...], list[tuple[np.ndarray, np.ndarray]]]:
        """(steps, (confidences, sorted survivals)) of the newest steps at least ``lag`` steps before the current
        one, newest first, until they hold ``pool_requests`` rows; none older than ``max_age`` but the newest
        (empty: no step is old enough yet)."""
        steps, pool = [], []
        oldest = -1 if self.max_age is None else self._step - self.max_age
        rows = 0
        for step, c, survivals, by_depth in reversed(self._history):
            if step < oldest and pool:  # too old to pool, unless it is all there is (then K keeps its basis)
                break
            if step <= self._step - self.lag and len(pool) < self.pool_steps:
                steps.append(step)
                pool.append((c, survivals, by_depth))
                rows += c.shape[0]
                if rows >= self.pool_requests:
                    break
        return tuple(steps), pool

    def prepare(self, n_requests: int, context: float | None = None) -> bool:
        """Fix K for the coming step (before drafting); returns whether the drafter should run. ``context``: the
        running requests' mean context in tokens (known before drafting, so it keeps K lossless)."""
        self._context = rounded_context(context)
        if self._long is not None:
            self._long.advance(self._step)
        pool_steps, c_old = self._old_confidences()
        ratio, confirm = 1.0, False
        if not c_old:
            self.last_capacity, self.last_ratio = None, None
        else:
            key = (pool_steps, n_requests, None if self.tracker is None else self.tracker.ratio,
                   None if self.live is None else self.live.rebuilds, self._context,
                   None if self._long is None else self._long.folded)
            if key != self._memo[0]:  # while the drafter is skipped nothing changes: K is reused, not recomputed
                self._memo = (key, *self._price(c_old, n_requests, pool_steps))
            _, best, ratio, self._grow, self._spread, self._depth = self._memo
            self.last_ratio = ratio
            margin = self._stay_gain(n_requests) if self.last_capacity else self.min_gain  # hysteresis
            starting = not self.last_capacity
            self.last_capacity = best if ratio > 1.0 + margin else 0
            if self.confirm and starting and self.last_capacity and self._thin(c_old, n_requests):
                confirm, self.last_capacity = pool_steps != self._confirmed, 0
                self._confirmed = pool_steps
        self._probing = False
        self._run = self._run + 1 if self.last_capacity else 0
        self._explore = bool(self.last_capacity) and self._drafting_steps % self.explore_every == 0
        self._drafting_steps += bool(self.last_capacity)
        if self.last_capacity:  # when this run ends, look again soon if a probe is just a drafting step
            if self.hold_backoff and n_requests < self._probe_load and self._run < DIP_STEPS:
                pass  # a dip below the load the probes were priced at (a request left, the next not yet in)
            elif n_requests <= self.probe_requests:
                self._interval, self._backoff_load = self.reprobe_every, 0
            elif self._run >= self.steady_run:  # a false start keeps the backed-off interval
                self._interval, self._backoff_load = self.probe_every, 0
        elif self.last_capacity == 0 and confirm:  # a promising thin pool: probe again before drafting for all
            self.last_capacity, self._probing = None, True
        elif self.last_capacity == 0 and self._skipped >= self._interval:
            self.last_capacity = None  # a probe: draft, verify by Algorithm 1, refresh the history
            self._interval = self._next_interval(ratio, n_requests)
            self._probing = True
        elif self.last_capacity == 0 and self._backoff_load and 2 * n_requests <= self._backoff_load:
            self._interval, self._backoff_load = min(self._interval, self.probe_every), 0  # the load fell: look soon
        self._planned = True
        return self.last_capacity != 0

    def _price(self, c_old, n_requests: int, steps: tuple[int, ...] = ()) -> tuple[int, float, bool, int | None, int]:
        """(best K, Θ_K / Θ_0, grow, spread, depth) from the pooled steps (see ``prepare``)."""
        adjust = self.tracker.adjust if self.tracker is not None else None  # scaled: their survivals change too
        if n_requests <= self.joint_requests:
            by_depth = [depth_survivals(adjust(c)) if adjust else d if d is not None else depth_survivals(c)
                        for c, _, d in c_old]
            if self._long is not None:
                by_depth = [self._long.shrunk(d, self.shrink) for d in by_depth]
            listed = steps and adjust is None and self._long is None and all(s in self._lists for s in steps)
            tables = [self._lists[s] for s in steps] if listed else None  # as select listed them
            best, depth, ratio = capacity_and_depth(by_depth, [c.shape[0] for c, _, _ in c_old], self.sps, n_requests,
                                                    tables, self.k_margin)
            return best, ratio, True, None, depth
        shapes = [c.shape for c, _, _ in c_old]
        survivals = [step_survivals(adjust(c)) if adjust else a for c, a, _ in c_old]
        best, ratio = capacity_from_survivals(survivals, shapes, self.sps, n_requests)
        grow = not self.lean_depth or best < 1 or could_grow(survivals, shapes, self.sps, n_requests, best)
        spread = self._longest_share(c_old, n_requests, best) if self.spread_depth else None
        return best, ratio, grow, spread, 0

    def _stay_gain(self, n_requests: int) -> float:
        """The margin a drafting run keeps on above: ``low_stay_gain`` at R <= ``joint_requests``, where the pools
        are few steps (the K = 0 they price is mostly their noise), else ``stay_gain``."""
        return self.low_stay_gain if n_requests <= self.joint_requests else self.stay_gain

    def _next_interval(self, ratio: float, n_requests: int) -> int:
        """Skipped steps before the probe after this one: soon while drafting is near paying at a load a probe
        drafts whole; doubling up to ``max_probe_every``, or ``far_probe_every`` while it is far from paying."""
        self._probe_load = n_requests
        if ratio >= 1.0 - self.near_loss and n_requests <= self.probe_requests:
            return self.reprobe_every
        far = ratio < 1.0 - self.far_loss and n_requests > self.probe_requests  # only thin probes, under load
        interval = min(2 * self._interval, self.far_probe_every if far else self.max_probe_every)
        backed_off = interval > (self.probe_every if self.watch_load else self.max_probe_every)
        self._backoff_load = (self._backoff_load or n_requests) if backed_off else 0
        return interval

    def _thin(self, c_old, n_requests: int) -> bool:
        """Whether the pool holds fewer rows than the batch it prices (a probe's two rows for eight requests)."""
        return sum(c.shape[0] for c, *_ in c_old) < min(self.pool_requests, n_requests)

    def draft_depth(self, gamma: int) -> int:
        """Slots worth drafting this step (after ``prepare``): K caps how deep any request can verify, and with
        ``spread_depth`` so does the longest prefix one request took in the pooled steps; at R <= ``joint_requests``
        the depth priced with K (one more on an exploring step)."""
        if self.last_capacity is None:  # Algorithm 1: a probe with a joint price drafts one slot past its depth
            return min(gamma, self._depth + 1) if self._probing and self._depth and self.shallow_probes else gamma
        if self._depth:  # joint_requests: the priced depth, one slot more on exploring steps
            return min(gamma, self._depth + self._explore)
        cap = self.last_capacity if self._grow else self.last_capacity - 1
        if self._spread is not None:
            cap = min(cap, self._spread)
        return draft_depth_for(cap, gamma)

    @staticmethod
    def _longest_share(c_old, n_requests: int, capacity: int) -> int | None:
        """The most slots one request took when each pooled step's own top-K was chosen, K scaled to that step's
        rows (a probe's two rows get their share of K). None when K = 0."""
        if capacity < 1:
            return None
        longest = 1
        for c, _, _ in c_old:
            k = max(1, round(capacity * c.shape[0] / n_requests))
            longest = max(longest, int(top_k_lengths(c, k).max()))
        return longest

    def requests_to_draft(self, n_requests: int) -> int:
        """How many of the step's requests to draft for (after ``prepare``): all, except on a probe."""
        return min(n_requests, self.probe_requests) if self._probing else n_requests

    def select(self, c=None, *, n_requests: int | None = None, gamma: int | None = None,
               drafted: list[int] | None = None) -> np.ndarray:
        """``drafted``: the rows of ``c`` that were drafted when only some were (the rest are zeros and verify
        nothing); only they enter the history."""
        n_req = np.shape(c)[0] if c is not None else n_requests
        if n_req is None:
            raise ValueError("without confidences, pass n_requests")
        if not self._planned:  # engines that never call prepare() still get the lossless behaviour
            self.prepare(int(n_req))
        self._planned = False
        step, self._step = self._step, self._step + 1
        if self.last_capacity == 0 and c is None:  # drafter skipped: plain decoding this step
            self._skipped += 1
            return np.zeros(int(n_req), dtype=np.int64)
        self._skipped = 0
        c = need_confidences(self.name, c)
        kept = c if drafted is None else c[list(drafted)]
        kept = kept.copy()  # the caller may reuse its buffer next step
        # by depth only for steps the size joint pricing sees (at R = 32 the γ sorts were work for nothing); a small
        # step's lists are kept for pricing and its survival rows serve its own top-K: after the model's forwards
        # each numpy call here costs several times what it does in a loop (scripts/policy_step_cost.py)
        joint = kept.shape[0] <= self.joint_requests
        small = small_step_lists(kept) if joint else None
        runs, lists = small if small is not None else (None, None)
        if lists is not None:
            self._lists[step] = lists
            if len(self._lists) > self._history.maxlen:
                del self._lists[next(iter(self._lists))]  # the oldest: it has left the history
        by_depth = np.array(lists) if lists is not None else depth_survivals(kept) if joint else None
        # its deepest row is the step's survivals, all R·d of them sorted (step_survivals): not sorted twice
        self._history.append((step, kept, step_survivals(kept) if by_depth is None else by_depth[-1], by_depth))
        if self._long is not None and by_depth is not None:
            self._long.add(step, by_depth)
        if self.tracker is not None:
            c = self.tracker.adjust(c)
        if self.last_capacity is None:
            return sync_prefix_schedule(c, self.sps)
        if self.early_stop:
            return sync_prefix_schedule(c, self.sps, capacity=self.last_capacity,
                                        depth=self.draft_depth(c.shape[1]))
        return top_k_lengths(c, self.last_capacity, runs if drafted is None and self.tracker is None else None)

    @property
    def observes_steps(self) -> bool:
        """Whether the engine should report each step's times (``observe_step``): only live prices use them."""
        return self.live is not None

    def observe_step(self, n_tokens: int, n_requests: int, forward_s: float, drafted: int = 0, depth: int = 0,
                     draft_s: float = 0.0, commit_s: float = 0.0, feed_s: float = 0.0) -> None:
        """After a target forward with no prefill in it: ``n_requests`` requests verified ``n_tokens`` tokens in
        ``forward_s`` and committed them in ``commit_s``; the step's proposal (if ``drafted`` > 0 requests) drafted
        ``depth`` slots in ``draft_s``, after feeding the drafter its deferred target states in ``feed_s``."""
        if self.live is not None:
            self.live.observe_step(n_tokens, n_requests, forward_s, self._context if self.prices_context else 0,
                                   drafted, depth, draft_s, commit_s, feed_s, overhead=self.live_overhead)

    def observe_outcomes(self, c, lengths, accepted) -> None:
        """After verification: the step's unadjusted confidences [R, γ], verified lengths [R], accepted [R]."""
        if self.tracker is not None and c is not None:
            self.tracker.update(c, lengths, accepted)
