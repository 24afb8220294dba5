"""Calibration and ranking metrics for binary events (no sklearn/scipy: these ship with the package).

Inputs everywhere: ``pred`` [N] predicted probabilities in [0, 1], ``y`` [N] 0/1 outcomes. ECE and reliability
bins also have vectorised forms over a leading axis ([G, N], one row per candidate temperature) because the
temperature grid search in calibration.py evaluates ~100 candidates per position.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def _bin_index(pred: np.ndarray, n_bins: int) -> np.ndarray:
    # Equal-width bins on [0, 1]; p = 1.0 belongs to the last bin, not to an extra one.
    return np.minimum((pred * n_bins).astype(np.int64), n_bins - 1)


def ece_rows(pred: np.ndarray, y: np.ndarray, n_bins: int = 15) -> np.ndarray:
    """ECE of each row of ``pred`` [G, N] against the same outcomes ``y`` [N] -> [G].

    ECE = sum over bins of (n_bin / N) * |mean pred - mean outcome| = (1/N) sum_bins |sum pred - sum y|,
    so one bincount per quantity over (row, bin) pairs does all rows at once.
    """
    pred = np.atleast_2d(np.asarray(pred, dtype=np.float64))
    y = np.asarray(y, dtype=np.float64)
    g, n = pred.shape
    if n == 0:
        return np.full(g, np.nan)
    flat = (np.arange(g)[:, None] * n_bins + _bin_index(pred, n_bins)).ravel()
    sum_p = np.bincount(flat, weights=pred.ravel(), minlength=g * n_bins)
    sum_y = np.bincount(flat, weights=np.broadcast_to(y, pred.shape).ravel(), minlength=g * n_bins)
    return np.abs(sum_p - sum_y).reshape(g, n_bins).sum(axis=1) / n


def log_loss_rows(pred: np.ndarray, y: np.ndarray, eps: float = 1e-9) -> np.ndarray:
    """Mean negative log-likelihood of each row of ``pred`` [G, N] against ``y`` [N] -> [G]. A proper scoring
    rule: unlike ECE it is not minimised by a constant prediction at the base rate (see calibration.py)."""
    pred = np.clip(np.atleast_2d(np.asarray(pred, dtype=np.float64)), eps, 1.0 - eps)
    y = np.asarray(y, dtype=np.float64)
    return -(y * np.log(pred) + (1.0 - y) * np.log1p(-pred)).mean(axis=1)


def ece(pred, y, n_bins: int = 15) -> float:
    """Expected calibration error with ``n_bins`` equal-width bins (fraction, not percent)."""
    return float(ece_rows(np.asarray(pred, dtype=np.float64)[None, :], y, n_bins)[0])


def ece_noise_floor(pred, n_bins: int = 15, draws: int = 200, seed: int = 0) -> float:
    """The ECE a PERFECTLY calibrated predictor shows on these predictions and this sample size: the mean ECE
    against outcomes drawn y ~ Bernoulli(pred). Binned ECE is biased upward by sampling noise (about
    sqrt(p(1 − p)/n_bin) per bin), so an ECE near this floor is as calibrated as N rounds can show."""
    pred = np.asarray(pred, dtype=np.float64)
    if pred.size == 0:
        return float("nan")
    rng = np.random.default_rng(seed)
    y = (rng.random((draws, pred.size)) < pred[None, :]).astype(np.float64)  # [draws, N]
    flat = (np.arange(draws)[:, None] * n_bins + _bin_index(pred, n_bins)[None, :]).ravel()
    sum_p = np.bincount(flat, weights=np.broadcast_to(pred, y.shape).ravel(), minlength=draws * n_bins)
    sum_y = np.bincount(flat, weights=y.ravel(), minlength=draws * n_bins)
    return float((np.abs(sum_p - sum_y).reshape(draws, n_bins).sum(axis=1) / pred.size).mean())


def average_ranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks with ties given their average rank (what the Mann-Whitney form of AUC needs) [N] -> [N]."""
    x = np.asarray(x, dtype=np.float64)
    order = np.argsort(x, kind="mergesort")
    xs = x[order]
    new_group = np.r_[True, xs[1:] != xs[:-1]]
    starts = np.flatnonzero(new_group)
    ends = np.r_[starts[1:], x.size]  # exclusive
    group_rank = (starts + ends + 1) / 2.0  # mean of 1-based ranks starts+1 .. ends
    ranks = np.empty(x.size)
    ranks[order] = group_rank[np.cumsum(new_group) - 1]
    return ranks


def roc_auc(score, y) -> float:
    """ROC-AUC = P(score of a random positive > that of a random negative) + 0.5 P(tie); NaN with one class."""
    score = np.asarray(score, dtype=np.float64)
    y = np.asarray(y).astype(bool)
    n_pos = int(y.sum())
    n_neg = y.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    r = average_ranks(score)
    return float((r[y].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def brier(pred, y) -> float:
    pred = np.asarray(pred, dtype=np.float64)
    return float(np.mean((pred - np.asarray(y, dtype=np.float64)) ** 2)) if pred.size else float("nan")


def reliability_bins(pred, y, n_bins: int = 15) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-bin (mean prediction, observed frequency, count), each [n_bins]; empty bins give NaN means."""
    pred = np.asarray(pred, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    idx = _bin_index(pred, n_bins)
    cnt = np.bincount(idx, minlength=n_bins).astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_p = np.bincount(idx, weights=pred, minlength=n_bins) / cnt
        freq = np.bincount(idx, weights=y, minlength=n_bins) / cnt
    return mean_p, freq, cnt


@dataclass(frozen=True)
class PositionMetrics:
    """Metrics of the cumulative confidence at one block position k against "slots 1..k all accepted"."""

    ece: float
    auc: float
    brier: float
    positive_rate: float  # fraction of rounds where slots 1..k were all accepted
    n: int
    ece_floor: float = float("nan")  # ece_noise_floor of the same predictions (NaN: not computed)

    @staticmethod
    def compute(pred, y, n_bins: int = 15) -> "PositionMetrics":
        y = np.asarray(y, dtype=np.float64)
        rate = float(y.mean()) if y.size else float("nan")
        return PositionMetrics(ece(pred, y, n_bins), roc_auc(pred, y), brier(pred, y), rate, int(y.size),
                               ece_noise_floor(pred, n_bins))
