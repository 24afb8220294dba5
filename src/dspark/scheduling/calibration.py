"""Sequential Temperature Scaling (STS): one temperature per block position, fitted left to right.

Data (held-out rollouts at full block length): raw confidence logits ``L`` [N, γ] and ``n_acc`` [N], the number
of leading drafts accepted in that round (0..γ). The scheduler consumes the *cumulative* product a_k =
prod_{i<=k} σ(L_i / T_i), the estimated probability that slots 1..k all survive, so that product — not each
per-slot factor — is what must be calibrated. STS therefore fits T_k to minimise the ECE of a_k against the event
"slots 1..k all accepted" (n_acc >= k) over ALL rounds, with T_1..T_{k-1} already fixed. (Fitting per-slot factors
on the rounds that reached slot k would calibrate the conditionals instead; errors would then compound along the
product, which is what the paper's sequential scheme avoids.)

The grid is log-spaced (0.05..20, 81 points) then refined between the best point's neighbours (41 points), since
ECE is piecewise-constant-ish in T and gradient methods would stall on it.

A temperature rescales a logit but cannot move it: a head that is over-confident by the same margin everywhere
(e.g. trained on answers sampled at T = 0.7 and calibrated at T = 1) keeps that offset. ``fit_sts(shift=True)``
also fits a per-position shift b_k, c_k = σ(L_k / T_k + b_k) (Platt scaling, applied sequentially in the same
way); the default, ``shift=False``, is the paper's STS (all b_k = 0).

The shifted fit minimises log loss, not ECE. With two free parameters ECE has a degenerate optimum: a large T
and a shift that put every round's confidence at the base rate score an ECE near zero while ranking nothing. One
half of session 33's rollouts (5,861 rounds) gave the shipped drafter's first slot that fit (T = 19.8: every
request's confidence nearly equal, so the scheduler could no longer tell a likely draft from an unlikely one),
the other half T = 1.28. Log loss is a proper scoring rule, so it rewards the sharpness ECE ignores: its fits
agree between the halves (slot 1: T 1.14, b −0.20 / −0.17) and held-out ECE and Brier score are at or below the
raw head's at slots 1–6 either way round (results/calibration-s34). The temperature-only fit keeps the paper's
ECE objective: one parameter cannot collapse the ranking that way.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import numpy as np

from ._jsonio import FileFormatError, check_header, finite_or_none, none_to_nan, read_json, write_json_atomic
from .metrics import PositionMetrics, ece_rows, log_loss_rows

FORMAT = "dspark.calibration"
VERSION = 2  # 2 added per-position shifts; version-1 files (temperatures only) still load, with b = 0
COARSE_GRID = np.geomspace(0.05, 20.0, 81)
SHIFT_GRID = np.linspace(-3.0, 3.0, 61)


class CalibrationFormatError(FileFormatError):
    """calibration.json is missing fields or has invalid values; the message names the file and the field."""


def sigmoid(x):
    # tanh form: no overflow warnings for large |x|, unlike 1 / (1 + exp(-x)).
    return 0.5 * (1.0 + np.tanh(0.5 * np.asarray(x, dtype=np.float64)))


def prefix_events(n_acc, gamma: int) -> np.ndarray:
    """y[n, k-1] = 1 if slots 1..k were all accepted in round n (n_acc >= k) -> [N, γ] float64."""
    n_acc = np.asarray(n_acc)
    if n_acc.ndim != 1 or np.any(n_acc < 0) or np.any(n_acc > gamma):
        raise ValueError(f"n_acc must be a 1-D array of counts in 0..{gamma}")
    return (n_acc[:, None] >= np.arange(1, gamma + 1)[None, :]).astype(np.float64)


def _check_data(logits, n_acc) -> tuple[np.ndarray, np.ndarray]:
    L = np.asarray(logits, dtype=np.float64)
    if L.ndim != 2 or L.shape[0] == 0 or not np.all(np.isfinite(L)):
        raise ValueError(f"logits must be a finite [N, gamma] array with N > 0, got shape {L.shape}")
    y = prefix_events(n_acc, L.shape[1])
    if y.shape[0] != L.shape[0]:
        raise ValueError(f"logits has {L.shape[0]} rounds but n_acc has {y.shape[0]}")
    return L, y


def _metrics(cum: np.ndarray, y: np.ndarray, n_bins: int) -> tuple[PositionMetrics, ...]:
    return tuple(PositionMetrics.compute(cum[:, k], y[:, k], n_bins) for k in range(y.shape[1]))


@dataclass(frozen=True)
class Calibration:
    temperatures: tuple[float, ...]  # [γ] T_k > 0
    before: tuple[PositionMetrics, ...] = ()  # [γ] metrics of the raw cumulative product (all T = 1)
    after: tuple[PositionMetrics, ...] = ()  # [γ] metrics after STS
    n_bins: int = 15
    n_rounds: int = 0
    shifts: tuple[float, ...] = ()  # [γ] b_k; () = all zero (the paper's STS)

    def __post_init__(self) -> None:
        t = tuple(float(x) for x in self.temperatures)
        if not t or not all(np.isfinite(x) and x > 0 for x in t):
            raise ValueError(f"temperatures must be a non-empty list of finite positive numbers, got {t}")
        b = tuple(float(x) for x in self.shifts) or (0.0,) * len(t)
        if len(b) != len(t) or not all(np.isfinite(x) for x in b):
            raise ValueError(f"shifts must be {len(t)} finite numbers (one per temperature), got {b}")
        object.__setattr__(self, "temperatures", t)
        object.__setattr__(self, "shifts", b)

    @property
    def gamma(self) -> int:
        return len(self.temperatures)

    @staticmethod
    def identity(gamma: int) -> "Calibration":
        return Calibration((1.0,) * gamma)

    def apply(self, logits):
        """Calibrated per-slot confidences c_k = σ(L_k / T_k + b_k); ``logits`` [..., g] numpy or torch (same type
        out), g ≤ γ: the first g positions (a drafter run at a shorter γ than it was calibrated for)."""
        g = np.shape(logits)[-1]
        if g > self.gamma:
            raise ValueError(f"logits last dimension {g} exceeds the calibrated block size {self.gamma}")
        temps, shifts = self.temperatures[:g], self.shifts[:g]
        if hasattr(logits, "new_tensor"):  # torch: stay on the tensor's device and dtype, no numpy round trip
            return (logits / logits.new_tensor(temps) + logits.new_tensor(shifts)).sigmoid()
        L = np.asarray(logits, dtype=np.float64)
        return sigmoid(L / np.asarray(temps) + np.asarray(shifts))

    def to_dict(self) -> dict:
        def rows(ms: tuple[PositionMetrics, ...]) -> list[dict]:
            return [{"ece": finite_or_none(m.ece), "auc": finite_or_none(m.auc), "brier": finite_or_none(m.brier),
                     "positive_rate": finite_or_none(m.positive_rate), "n": m.n,
                     "ece_floor": finite_or_none(m.ece_floor)} for m in ms]

        return {"format": FORMAT, "version": VERSION, "temperatures": list(self.temperatures),
                "shifts": list(self.shifts), "n_bins": self.n_bins,
                "n_rounds": self.n_rounds, "metrics": {"before": rows(self.before), "after": rows(self.after)}}

    def save(self, path: str | os.PathLike) -> Path:
        return write_json_atomic(path, self.to_dict())

    @staticmethod
    def from_dict(obj: dict, path: str | os.PathLike = "<dict>") -> "Calibration":
        check_header(obj, path, fmt=FORMAT, version=(1, VERSION), error=CalibrationFormatError)
        temps = obj.get("temperatures")
        if not isinstance(temps, list) or not temps or not all(
            isinstance(t, (int, float)) and not isinstance(t, bool) and np.isfinite(t) and t > 0 for t in temps
        ):
            raise CalibrationFormatError(
                f"{path}: 'temperatures' must be a non-empty list of positive numbers, got {temps!r}")
        metrics = obj.get("metrics", {"before": [], "after": []})

        def rows(name: str) -> tuple[PositionMetrics, ...]:
            items = metrics.get(name, []) if isinstance(metrics, dict) else None
            if not isinstance(items, list) or (items and len(items) != len(temps)):
                raise CalibrationFormatError(
                    f"{path}: 'metrics.{name}' must be a list with one entry per position ({len(temps)})")
            try:
                return tuple(PositionMetrics(none_to_nan(m["ece"]), none_to_nan(m["auc"]), none_to_nan(m["brier"]),
                                             none_to_nan(m["positive_rate"]), int(m["n"]),
                                             none_to_nan(m.get("ece_floor"))) for m in items)
            except (KeyError, TypeError, ValueError) as e:
                raise CalibrationFormatError(f"{path}: bad entry in 'metrics.{name}': {e!r}") from e

        n_bins, n_rounds = obj.get("n_bins", 15), obj.get("n_rounds", 0)
        if not isinstance(n_bins, int) or n_bins < 1 or not isinstance(n_rounds, int) or n_rounds < 0:
            raise CalibrationFormatError(f"{path}: 'n_bins' and 'n_rounds' must be non-negative integers")
        shifts = obj.get("shifts", [0.0] * len(temps))
        if not isinstance(shifts, list) or len(shifts) != len(temps) or not all(
            isinstance(b, (int, float)) and not isinstance(b, bool) and np.isfinite(b) for b in shifts
        ):
            raise CalibrationFormatError(f"{path}: 'shifts' must be a list of {len(temps)} finite numbers, "
                                         f"got {shifts!r}")
        return Calibration(tuple(temps), rows("before"), rows("after"), n_bins, n_rounds, tuple(shifts))

    @staticmethod
    def load(path: str | os.PathLike) -> "Calibration":
        return Calibration.from_dict(read_json(path, kind="calibration", error=CalibrationFormatError), path)


def _best_temperature(prev: np.ndarray, logit: np.ndarray, y: np.ndarray, score, shift: float = 0.0
                      ) -> tuple[float, float]:
    """argmin_T score(prev * σ(logit / T + shift), y) over the coarse grid, then a fine grid between its
    neighbours -> (T, its score). ``score``: [G, N] predictions, [N] outcomes -> [G]."""
    grid = COARSE_GRID
    for _ in range(2):
        e = score(prev[None, :] * sigmoid(logit[None, :] / grid[:, None] + shift), y)
        i = int(np.argmin(e))  # first minimum: deterministic on plateaus
        best, best_e = float(grid[i]), float(e[i])
        lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, grid.size - 1)]
        grid = np.geomspace(lo, hi, 41)
    return best, best_e


def _best_temperature_and_shift(prev, logit, y) -> tuple[float, float]:
    """Shift on a grid (coarse, then between the best point's neighbours), the best T for each, by log loss
    (module docstring) -> (T, b). Ties go to the smallest |b|."""
    grid = SHIFT_GRID[np.argsort(np.abs(SHIFT_GRID), kind="stable")]
    for _ in range(2):
        fits = [(*_best_temperature(prev, logit, y, log_loss_rows, float(b)), float(b)) for b in grid]
        t, _, b = min(fits, key=lambda f: f[1])  # first minimum in |b| order
        step = float(np.abs(np.diff(np.sort(grid))).min())
        grid = np.concatenate([[b], np.linspace(b - step, b + step, 21)])
    return t, b


def fit_sts(logits, n_acc, *, n_bins: int = 15, shift: bool = False) -> Calibration:
    """Fit STS on ``logits`` [N, γ] and ``n_acc`` [N]; returns temperatures (by ECE; with ``shift=True``,
    temperatures and shifts by log loss) plus before/after metrics (in-sample; evaluate on held-out rounds with
    ``evaluate`` for an unbiased report)."""
    L, y = _check_data(logits, n_acc)
    temps: list[float] = []
    shifts: list[float] = []
    prev = np.ones(L.shape[0])
    for k in range(L.shape[1]):
        t, b = (_best_temperature_and_shift(prev, L[:, k], y[:, k]) if shift
                else (_best_temperature(prev, L[:, k], y[:, k], partial(ece_rows, n_bins=n_bins))[0], 0.0))
        temps.append(t)
        shifts.append(b)
        prev = prev * sigmoid(L[:, k] / t + b)
    fitted = Calibration(tuple(temps), n_bins=n_bins, n_rounds=int(L.shape[0]), shifts=tuple(shifts))
    raw = evaluate(Calibration.identity(L.shape[1]), L, n_acc, n_bins=n_bins)
    return replace(fitted, before=raw, after=evaluate(fitted, L, n_acc, n_bins=n_bins))


def evaluate(cal: Calibration, logits, n_acc, *, n_bins: int = 15) -> tuple[PositionMetrics, ...]:
    """Per-position metrics [γ] of the calibrated cumulative product on (possibly held-out) rounds."""
    L, y = _check_data(logits, n_acc)
    return _metrics(np.cumprod(cal.apply(L), axis=1), y, n_bins)
