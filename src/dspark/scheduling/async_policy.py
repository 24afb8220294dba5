"""The asynchronous DSpark scheduler: verification capacity K from old confidences, top-K of the current ones."""

from __future__ import annotations

from collections import deque

import numpy as np

from .acceptance_tracker import AcceptanceTracker
from .live_profile import LiveProfile
from .depth_pricing import capacity_and_depth, depth_survivals
from .policies import (SPS, capacity_from_survivals, could_grow, draft_depth_for, rounded_context, step_survivals,
                       sync_prefix_schedule, top_k_lengths)
from .policy_objects import need_confidences


class AsyncPolicy:
    """Asynchronous scheduler: K from the confidences of a step at least ``lag`` steps old, then top-K of the
    current ones.

    A production engine computes K for step t while step t-1 runs, from the last confidences it has, which are
    step t-2's — hence lag 2. Call ``prepare(R)`` before drafting: it computes K and returns False when K = 0,
    i.e. the drafter can be skipped this step (see ``async_capacity``).

    Skipped steps produce no confidences, so without care one unlucky K = 0 would hold forever (the history
    would never change again) even after the load falls or the text turns easy. Hence probes: after
    ``probe_every`` skipped steps in a row the drafter runs anyway, and that step verifies by Algorithm 1 on its
    own confidences; two steps later its confidences set K. Each probe that still yields K = 0 doubles the
    interval (up to ``max_probe_every``), so a load where speculation never pays costs one drafting pass per
    ~65 steps (≈ 0.3 % with drafting at 20 % of a step); any K > 0 resets it. Whether a step probes depends
    only on counts of skipped steps and on old confidences, never on the current tokens, so it stays lossless.
    For the first steps there is no old enough history; rather than use the current confidences for K (that would
    make K depend on the current tokens and break losslessness), we fall back to Algorithm 1 with early stop,
    which is lossless on its own.

    K > 0 only when its predicted throughput beats plain decoding by more than ``min_gain`` (3 %): the profile
    prices engine steps only to within ~3 % on the dev CPU (``scripts/engine_step_times.py``), and a drafting
    decision inside that error is a coin flip that costs the drafter's time either way.

    The two decisions are not symmetric in time, and the policy makes up for it. While it drafts, every step
    brings new confidences and K is re-priced each step; a K = 0 decision brings none and holds until the next
    probe. With a one-sided rule a drafting run ended at the first noisy pool under the margin and then paid a
    probe interval, doubling with each probe, plus the lag before it could resume: at C = 2 on the dev CPU 66 % of
    the distinct pools priced K > 0 (median predicted gain 9 %) yet 14 % of the steps drafted
    (scripts/async_pricing_spy.py), and MTP-1 beat the policy by 7 % (results/serving-s13-kernels-low). Hence: (1) hysteresis — once drafting it keeps drafting while
    the best K beats plain decoding by more than ``stay_gain`` (default 0: at all); (2) a probe that drafts every
    running request (R <= ``probe_requests``) is an ordinary drafting step verified by Algorithm 1, so at such
    loads the first probe after a drafting run comes after ``reprobe_every`` skipped steps (default 2, or
    ``max_probe_every`` if less; at larger R ``probe_every``), and while the best K is priced within
    ``near_loss`` (5 %) of plain decoding the probes keep coming that often instead of backing off. All depend only on past decisions and old confidences, so they stay
    lossless.

    K is known before drafting, so only ``draft_depth(γ)`` = min(γ, K + 1) slots are drafted (no request can verify
    more than K; the extra slot's confidence lets the next K grow), and ``async_capacity`` prices each K at that
    depth when the profile has a depth-1 drafting table. Any depth fixed before drafting keeps the output exact.

    A probe drafts only ``probe_requests`` requests (default 2; the engine picks those with the fewest target
    states still to feed the drafter), the others verify nothing that step: a probe exists to refresh the
    confidence history, and under load drafting every request — and first feeding each one the states of every
    token since its last draft — cost a probe 3× a plain step (C = 8 on the dev CPU), ~2 % of all time at one
    probe per 64 steps. Only the probed rows enter the history (pooling weighs steps by their rows).

    K pools the newest old-enough steps until they hold ``pool_requests`` rows (at most ``pool_steps`` steps, none
    older than ``max_age`` steps unless it is the newest one; see ``async_capacity``): at high load that is the one
    step lag 2 names, at R = 1 the last 8 drafted steps. The age limit matters after a run of skipped steps: the
    pool was then mostly the weak steps that ended the last drafting run, one probe row could not outweigh them,
    and each probe doubled the interval to the next (at C = 2, 850 skipped steps in 60 s with it, 1,969 without).

    With ``early_stop`` the step admits its K drafts by Algorithm 1 on the current confidences, stopping where the
    next draft no longer pays (``sync_prefix_schedule`` capped at K) instead of taking the top K unconditionally:
    K from a pool of old steps over-promises when the text just turned hard — at C = 1 on the dev CPU 14 % of the
    steps verified K >= 4 drafts of which 15 % were accepted (results/serving-s18-mingain). Lossless for the
    same reason as Algorithm 1: the cap and the stop read only slots visited earlier. Not the default: in the
    slow phase of session 19 the profile never let K pass 1 at C = 1 and the decisions came out the same
    (results/serving-s19-early-stop).

    With ``lean_depth`` the extra slot is drafted only while K + 1 could pay (``could_grow``: even if the next
    draft were as likely as the K-th): on the dev CPU's slow phase a third token in a one-request step cost 24 ms
    more than a second (81 against 57 ms, ``dspark profile --drafter dspark``), no slot-2 confidence could make
    K = 2 pay, and drafting slot 2 for nothing cost ~1.1 ms a step (the profile's depth-1 and depth-7 prices). Lossless: it reads the same old confidences as K. Not the default: drafting fell
    from 10.8 to 10.4 % of step time at C = 1 and throughput did not move measurably (results/serving-s19-lean).

    With ``spread_depth`` (the default since session 29) the drafted depth is also capped by how K was shared in
    the pooled steps: one more than the most slots a single request took when each pooled step's own top-K was
    chosen. K counts the drafts of the whole batch, but at R = 2 on the dev CPU (slow state of session 29) K >= 4
    on 94 % of the steps verified 3.9 drafts a step for the two requests, while K + 1 >= 5 slots were drafted per
    request, 5.7 ms of drafting a step against fixed-2's depth 2 (results/decisions-s29). With the cap: 1.017 [1.008, 1.022] of the uncapped
    throughput at C = 2, 1.013 [1.012, 1.015] at C = 4, 0.997 at C = 1 where it cannot bite (3 repeats, paired;
    results/spread-s29). Lossless: the cap reads only old confidences. K is still priced at depth K + 1, which
    errs on the side of drafting less.

    At loads of at most ``joint_requests`` requests (default 2) K and the drafted depth d are priced together:
    each d from 1 to the deepest any pooled step drafted, priced from the pooled steps that drafted at least d
    slots, truncated to d, with drafting at d, and the best (K <= R·d, d) wins (``capacity_and_depth``); top-K
    then picks among the slots drafted. Priced at depth K + 1, K = 4 at R = 2 charged five drafted slots a request
    where two requests verifying two drafts each need two, exactly fixed-2's step: the policy settled on K = 3 at
    depth 3-4, and with fixed-2 in the grid it reached 0.93-0.94 of it at C = 2 (bf16, T = 1; joint pricing
    0.96-0.99 in the same runs: results/serving-s40-t1-bf16, -joint-low, -joint-online, -joint-c4). A depth
    nothing in the pool drafted cannot be priced, so every ``explore_every``-th drafting step (counted over the
    whole run, the first one included) drafts one slot more; top-K may take it too. Why not at every load: at C = 4
    joint pricing found MTP-1's shape (K = R, depth 1) worth drafting off a probe's two rows, where on this CPU
    MTP-1 runs at 0.94 of plain decoding; drafting runs that start after skipped steps pay for feeding the drafter
    the states it missed, which the profile does not price, and pricing at depth K + 1 kept that margin (async
    0.976-0.987 of the best fixed policy at C = 4 with it, 0.961-0.981 with joint pricing, in the same runs). With
    R <= ``probe_requests`` every probe drafts all requests, so pools are whole and drafting runs long. Lossless:
    d, K and the exploring step read only old confidences and counts of past decisions.

    With ``online_calibration`` (policy ``async-online``) every confidence it uses is first scaled by the ratio of
    accepted to predicted drafts on the verified slots so far (``acceptance_tracker.py``); the engine reports each
    verified step through ``observe_outcomes``. Not the default: on the dev CPU it lowered the verify budget where
    the offline calibration ran over-confident but bought no throughput (results/serving-dspark-more).

    Two rules for loads where a probe drafts fewer requests than the batch holds (R > ``probe_requests``):
    with ``confirm`` a pool thinner than the batch (fewer than min(``pool_requests``, R) rows: a probe's two
    rows pricing K for eight requests) that prices K > 0 from a skipped state is probed again before every
    request drafts, and K > 0 comes once the pooled probes hold enough rows: on the dev AVX-512 CPU at C = 4,
    steps verifying K >= 4 drafts from two-row pools accepted 28 % of them against 43 % for the probes' own
    Algorithm 1 (scripts/engine_step_times.py --async-decisions). With ``steady_run`` = n a drafting run
    resets the probe interval only once it has lasted n steps; a shorter one (a false start on a lucky probe)
    keeps the backed-off interval, where by default every such run reset it and the probes never backed off
    (C = 4: 132 probes in 90 s, 74 with ``steady_run=4``). Both read only past decisions and old confidences.

    With ``far_probe_every`` above ``max_probe_every`` (say 256) probes back off further under a steady load
    where speculation is far from paying: a probe of fewer requests than the batch holds, whose pool priced the
    best K more than ``far_loss`` (10 %, three times the profile's pricing error) below plain decoding, lets the
    interval go on doubling up to ``far_probe_every``, and what would make drafting pay sooner, the load
    falling, is watched instead: once the batch holds at most half the requests it held when the interval passed
    ``max_probe_every``, the next probe comes after ``probe_every`` skipped steps. At C = 8 on the dev AVX-512
    CPU, probes at the 64-step cap came once in ~50 steps, each 7.3 ms over a plain step (two requests drafted
    and fed their backlog), 0.4 % of all step time; at C = 16 the pools before them priced 0.82–0.85 of plain
    decoding (``scripts/engine_step_times.py --async-decisions``, results/decisions-s24). With
    ``far_probe_every=256`` probes at C = 16 fell from 31 to 12 in 90 s, but throughput did not move measurably
    (results/serving-s24-far: 1.006 / 1.002 / 0.998 / 1.001 for the 64-step cap over it at C = 4 / 8 / 16 /
    32), so it is not the default. Both rules read only past prices and request counts, so they stay lossless.

    With ``price_context`` (the default) each step is priced at the running requests' mean context, which the
    engine passes to ``prepare``: every verified token attends to its request's whole context, so verification
    costs more than the profile's grid (measured at 256 tokens) says once contexts grow long, and less below (see
    ``profile.py``). ``price_context=0`` prices every step at the grid's context, as before session 26.

    With ``live`` the profile's prices follow the step times the engine reports through ``observe_step``
    (``live_profile.py``: plain, verify and drafting prices each corrected by the median measured / predicted
    ratio of their recent steps), for a machine whose speed drifts after the profile was measured.
    """

    needs_confidence = True
    drafts = True
    load_dependent = True  # K comes from the batch's confidences and the price of a step at its size

    def __init__(self, sps: SPS, lag: int = 2, probe_every: int = 8, max_probe_every: int = 64,
                 pool_requests: int = 8, pool_steps: int = 8, online_calibration: bool = False,
                 min_gain: float = 0.03, probe_requests: int = 2, stay_gain: float | None = 0.0,
                 reprobe_every: int | None = None, max_age: int | None = 16, near_loss: float = 0.05,
                 early_stop: bool = False, lean_depth: bool = False, live: bool = False, steady_run: int = 1,
                 confirm: bool = False, far_loss: float = 0.1, far_probe_every: int | None = None,
                 price_context: bool = True, spread_depth: bool = True, joint_requests: int = 2,
                 explore_every: int = 8):
        if lag < 1:
            raise ValueError(f"lag must be >= 1 (lag 0 would read the current tokens), got {lag}")
        if not 1 <= probe_every <= max_probe_every:
            raise ValueError(f"need 1 <= probe_every <= max_probe_every, got {probe_every}, {max_probe_every}")
        if not 0.0 <= min_gain < 1.0:
            raise ValueError(f"min_gain must lie in [0, 1), got {min_gain}")
        stay_gain = min_gain if stay_gain is None else stay_gain  # None: no hysteresis
        if not -1.0 < stay_gain <= min_gain:
            raise ValueError(f"stay_gain must lie in (-1, min_gain = {min_gain}], got {stay_gain}")
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
        self.stay_gain, self.reprobe_every = stay_gain, reprobe_every
        if max_age is not None and max_age < lag:
            raise ValueError(f"max_age must be >= lag = {lag} (None: no limit), got {max_age}")
        self.max_age = max_age
        if not 0.0 <= near_loss < 1.0:
            raise ValueError(f"near_loss must lie in [0, 1), got {near_loss}")
        self.near_loss = near_loss
        if early_stop not in (0, 1):  # also spelled async:early_stop=1
            raise ValueError(f"early_stop must be a bool (0 or 1), got {early_stop!r}")
        self.early_stop = bool(early_stop)
        if lean_depth not in (0, 1):
            raise ValueError(f"lean_depth must be a bool (0 or 1), got {lean_depth!r}")
        self.lean_depth = bool(lean_depth)
        if live not in (0, 1):
            raise ValueError(f"live must be a bool (0 or 1), got {live!r}")
        if steady_run < 1:
            raise ValueError(f"steady_run must be >= 1, got {steady_run}")
        self.steady_run = steady_run
        if confirm not in (0, 1):
            raise ValueError(f"confirm must be a bool (0 or 1), got {confirm!r}")
        self.confirm = bool(confirm)
        if not 0.0 < far_loss < 1.0:
            raise ValueError(f"far_loss must lie in (0, 1), got {far_loss}")
        far_probe_every = max_probe_every if far_probe_every is None else far_probe_every  # None: no far back-off
        if far_probe_every < max_probe_every:
            raise ValueError(f"need far_probe_every >= max_probe_every = {max_probe_every}, got {far_probe_every}")
        self.far_loss, self.far_probe_every = far_loss, far_probe_every
        if price_context not in (0, 1):
            raise ValueError(f"price_context must be a bool (0 or 1), got {price_context!r}")
        self.prices_context = bool(price_context)  # prepare() takes the requests' mean context (see ``sps``)
        if spread_depth not in (0, 1):
            raise ValueError(f"spread_depth must be a bool (0 or 1), got {spread_depth!r}")
        self.spread_depth = bool(spread_depth)
        if joint_requests < 0:
            raise ValueError(f"joint_requests must be >= 0 (0: never), got {joint_requests}")
        if explore_every < 1:
            raise ValueError(f"explore_every must be >= 1, got {explore_every}")
        self.joint_requests, self.explore_every = int(joint_requests), explore_every
        self.live = LiveProfile(sps) if live else None  # kept across reset(): it describes the machine
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
        self._step = 0  # index of the step being planned
        self._skipped = 0  # drafter-skipped steps in a row
        self._interval = self.probe_every  # skipped steps before the next probe
        self._run = 0  # K > 0 steps in a row
        self._far_load = 0  # requests in the batch when the interval passed max_probe_every (0: it has not)
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
        pool_steps, c_old = self._old_confidences()
        ratio, confirm = 1.0, False
        if not c_old:
            self.last_capacity, self.last_ratio = None, None
        else:
            key = (pool_steps, n_requests, None if self.tracker is None else self.tracker.ratio,
                   None if self.live is None else self.live.rebuilds, self._context)
            if key != self._memo[0]:  # while the drafter is skipped nothing changes: K is reused, not recomputed
                self._memo = (key, *self._price(c_old, n_requests))
            _, best, ratio, self._grow, self._spread, self._depth = self._memo
            self.last_ratio = ratio
            margin = self.stay_gain if self.last_capacity else self.min_gain  # hysteresis: drafting keeps on
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
            if n_requests <= self.probe_requests:
                self._interval, self._far_load = self.reprobe_every, 0
            elif self._run >= self.steady_run:  # a false start keeps the backed-off interval
                self._interval, self._far_load = self.probe_every, 0
        elif self.last_capacity == 0 and confirm:  # a promising thin pool: probe again before drafting for all
            self.last_capacity, self._probing = None, True
        elif self.last_capacity == 0 and self._skipped >= self._interval:
            self.last_capacity = None  # a probe: draft, verify by Algorithm 1, refresh the history
            self._interval = self._next_interval(ratio, n_requests)
            self._probing = True
        elif self.last_capacity == 0 and self._far_load and 2 * n_requests <= self._far_load:
            self._interval, self._far_load = min(self._interval, self.probe_every), 0  # the load fell: look soon
        self._planned = True
        return self.last_capacity != 0

    def _price(self, c_old, n_requests: int) -> tuple[int, float, bool, int | None, int]:
        """(best K, Θ_K / Θ_0, grow, spread, depth) from the pooled steps (see ``prepare``)."""
        adjust = self.tracker.adjust if self.tracker is not None else None  # scaled: their survivals change too
        if n_requests <= self.joint_requests:
            by_depth = [depth_survivals(adjust(c)) if adjust else d if d is not None else depth_survivals(c)
                        for c, _, d in c_old]
            best, depth, ratio = capacity_and_depth(by_depth, [c.shape[0] for c, _, _ in c_old], self.sps, n_requests)
            return best, ratio, True, None, depth
        shapes = [c.shape for c, _, _ in c_old]
        survivals = [step_survivals(adjust(c)) if adjust else a for c, a, _ in c_old]
        best, ratio = capacity_from_survivals(survivals, shapes, self.sps, n_requests)
        grow = not self.lean_depth or best < 1 or could_grow(survivals, shapes, self.sps, n_requests, best)
        spread = self._longest_share(c_old, n_requests, best) if self.spread_depth else None
        return best, ratio, grow, spread, 0

    def _next_interval(self, ratio: float, n_requests: int) -> int:
        """Skipped steps before the probe after this one: soon while drafting is near paying at a load a probe
        drafts whole; doubling up to ``max_probe_every``, or ``far_probe_every`` while it is far from paying."""
        if ratio >= 1.0 - self.near_loss and n_requests <= self.probe_requests:
            return self.reprobe_every
        far = ratio < 1.0 - self.far_loss and n_requests > self.probe_requests  # only thin probes, under load
        interval = min(2 * self._interval, self.far_probe_every if far else self.max_probe_every)
        self._far_load = (self._far_load or n_requests) if interval > self.max_probe_every else 0
        return interval

    def _thin(self, c_old, n_requests: int) -> bool:
        """Whether the pool holds fewer rows than the batch it prices (a probe's two rows for eight requests)."""
        return sum(c.shape[0] for c, *_ in c_old) < min(self.pool_requests, n_requests)

    def draft_depth(self, gamma: int) -> int:
        """Slots worth drafting this step (after ``prepare``): K caps how deep any request can verify, and with
        ``spread_depth`` so does the longest prefix one request took in the pooled steps; at R <= ``joint_requests``
        the depth priced with K (one more on an exploring step)."""
        if self.last_capacity is None:
            return gamma
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
        # by depth only for steps the size joint pricing sees (at R = 32 the γ sorts were work for nothing)
        by_depth = depth_survivals(kept) if kept.shape[0] <= self.joint_requests else None
        # its deepest row is the step's survivals, all R·d of them sorted (step_survivals): not sorted twice
        self._history.append((step, kept, step_survivals(kept) if by_depth is None else by_depth[-1], by_depth))
        if self.tracker is not None:
            c = self.tracker.adjust(c)
        if self.last_capacity is None:
            return sync_prefix_schedule(c, self.sps)
        if self.early_stop:
            return sync_prefix_schedule(c, self.sps, capacity=self.last_capacity,
                                        depth=self.draft_depth(c.shape[1]))
        return top_k_lengths(c, self.last_capacity)

    @property
    def observes_steps(self) -> bool:
        """Whether the engine should report each step's times (``observe_step``): only live prices use them."""
        return self.live is not None

    def observe_step(self, n_tokens: int, n_requests: int, forward_s: float, drafted: int = 0, depth: int = 0,
                     draft_s: float = 0.0) -> None:
        """After a target forward with no prefill in it: ``n_requests`` requests verified ``n_tokens`` tokens in
        ``forward_s``; the step's proposal (if ``drafted`` > 0 requests) drafted ``depth`` slots in ``draft_s``."""
        if self.live is None:
            return
        self.live.observe_forward(n_tokens, n_requests, forward_s, self._context if self.prices_context else 0)
        if drafted:
            self.live.observe_draft(drafted, depth, draft_s)

    def observe_outcomes(self, c, lengths, accepted) -> None:
        """After verification: the step's unadjusted confidences [R, γ], verified lengths [R], accepted [R]."""
        if self.tracker is not None and c is not None:
            self.tracker.update(c, lengths, accepted)
