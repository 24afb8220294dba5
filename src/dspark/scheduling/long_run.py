"""The long-run mean of the drafted steps' survivals, which the async scheduler's pools are shrunk toward at low
load (``AsyncPolicy``'s ``shrink``).

At one request a pool is its last eight drafted steps, and how those went says little about the next one: on the
`bench serve` mix at C = 1 (session 44, Intel Xeon; results/intel-s44/realization-c1-async.txt) the steps whose
pool promised most (0.94 accepted drafts, top quartile) accepted 0.49, the bottom quartile (0.36 promised) 0.39.
So the best K swung with the pool — K >= 4 on a quarter of the steps, which accepted what K = 3 steps did, and now
and then no drafting at all — where the mean of many steps prices K = 2-3 on every one. A shrunk pool,
``mean + shrink · (pool - mean)``, keeps what the pool does predict and prices the rest at the mean.

Measured, and not the default: it removed the probes at C = 1 but not the deep steps, and throughput stayed
within 2 % of the plain pools' at C = 1 and 2 (results/serving-s44-shrink-low; docs/async-scheduler.md).

Survivals are kept per batch size R and drafted depth as ``depth_survivals`` gives them (row i: the descending
survivals of a step's first i + 1 slots, [R·(i + 1)]), summed over the last ``window`` steps folded in. A step is
folded in only once it is ``lag`` steps old, like the pools themselves, so the mean at step t reads the
confidences of steps before t - lag + 1 only: lossless for the same reason as the pools (DESIGN.md invariant 3).
"""
from __future__ import annotations

from collections import deque

import numpy as np


class LongRunSurvivals:
    def __init__(self, window: int, lag: int):
        if window < 1:
            raise ValueError(f"the long-run window must hold >= 1 steps, got {window}")
        self.window, self.lag = window, lag
        self.reset()

    def reset(self) -> None:
        self._pending: deque[tuple[int, np.ndarray]] = deque()  # (step, by_depth) not yet `lag` steps old
        self._kept: deque[np.ndarray] = deque()  # folded in, oldest first
        self._sums: dict[int, np.ndarray] = {}  # R -> [depth, R·depth]: the kept steps' by_depth, zero-padded
        self._counts: dict[int, np.ndarray] = {}  # R -> [depth]: kept steps that drafted at least each depth
        self.folded = 0  # steps folded in so far (a pricing memo key)

    def add(self, step: int, by_depth: np.ndarray) -> None:
        """A drafted step's ``depth_survivals`` [d, R·d] (R = its rows)."""
        self._pending.append((step, by_depth))

    def advance(self, step: int) -> None:
        """Fold in the pending steps at least ``lag`` steps before ``step``, dropping those past the window."""
        while self._pending and self._pending[0][0] <= step - self.lag:
            m = self._pending.popleft()[1]
            self._change(m, +1)
            self._kept.append(m)
            self.folded += 1
            if len(self._kept) > self.window:
                self._change(self._kept.popleft(), -1)

    def _change(self, m: np.ndarray, sign: int) -> None:
        depth, width = m.shape
        r = width // depth
        sums, counts = self._sums.get(r), self._counts.get(r)
        if sums is None or sums.shape[0] < depth:  # grow to the deepest step seen at this R
            grown, grown_counts = np.zeros((depth, r * depth)), np.zeros(depth)
            if sums is not None:
                grown[:sums.shape[0], :sums.shape[1]] = sums
                grown_counts[:counts.shape[0]] = counts
            sums, counts = self._sums[r], self._counts[r] = grown, grown_counts
        sums[:depth, :width] += sign * m
        counts[:depth] += sign

    def shrunk(self, by_depth: np.ndarray, weight: float) -> np.ndarray:
        """``by_depth`` [d, R·d] moved toward the long-run mean of steps of its R: mean + weight · (by_depth - mean)
        at each depth the mean has steps for; the rest unchanged. A convex mix of two descending rows in [0, 1]
        descends in [0, 1] too, so it prices like any step's survivals."""
        depth, width = by_depth.shape
        r = width // depth
        sums, counts = self._sums.get(r), self._counts.get(r)
        if sums is None:
            return by_depth
        out = by_depth.copy()
        for i in range(min(depth, counts.shape[0])):
            if counts[i] > 0:
                n = r * (i + 1)  # the row's survivals; past them it is zero padding in both
                mean = sums[i, :n] / counts[i]
                out[i, :n] = mean + weight * (by_depth[i, :n] - mean)
        return out
