"""Acceptance traces: what the serving simulator replays.

One round = (calibrated per-slot confidences [γ], number of leading drafts accepted when the full block was
verified). Because acceptance is left to right, verifying only ℓ drafts of that round accepts min(n_acc, ℓ) —
which is what lets one recording at full block length stand in for every policy.

Traces come from real rollouts (``from_rollouts``: raw confidence logits + n_acc, calibrated with STS) or are
synthesised (``synthetic_traces``) for tests and for what-if studies before a drafter exists.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ._jsonio import write_npz_atomic
from .calibration import Calibration


@dataclass(frozen=True)
class AcceptanceTraces:
    conf: np.ndarray  # [M, γ] float64 calibrated per-slot confidences in [0, 1]
    n_acc: np.ndarray  # [M] int64 accepted drafts at full block, 0..γ

    def __post_init__(self) -> None:
        conf = np.ascontiguousarray(self.conf, dtype=np.float64)
        n_acc = np.ascontiguousarray(self.n_acc, dtype=np.int64)
        if conf.ndim != 2 or conf.shape[0] == 0 or n_acc.shape != (conf.shape[0],):
            raise ValueError(f"need conf [M, gamma] with M > 0 and n_acc [M]; got {conf.shape} and {n_acc.shape}")
        if not (np.all(conf >= 0) and np.all(conf <= 1)):
            raise ValueError("conf must be calibrated probabilities in [0, 1]")
        if np.any(n_acc < 0) or np.any(n_acc > conf.shape[1]):
            raise ValueError(f"n_acc must lie in 0..{conf.shape[1]}")
        conf.setflags(write=False)  # frozen record: shared between simulations, must not be mutated
        n_acc.setflags(write=False)
        object.__setattr__(self, "conf", conf)
        object.__setattr__(self, "n_acc", n_acc)

    @property
    def gamma(self) -> int:
        return self.conf.shape[1]

    def __len__(self) -> int:
        return self.conf.shape[0]

    def tau(self, verify: int | None = None) -> float:
        """Mean tokens emitted per round when verifying ``verify`` drafts (default all γ)."""
        ell = self.gamma if verify is None else verify
        return float(np.minimum(self.n_acc, ell).mean() + 1.0)

    def save(self, path: str | os.PathLike) -> Path:
        return write_npz_atomic(path, conf=self.conf, n_acc=self.n_acc, version=np.int64(1))

    @staticmethod
    def load(path: str | os.PathLike) -> "AcceptanceTraces":
        with np.load(path) as z:
            if "conf" not in z or "n_acc" not in z:
                raise ValueError(f"{path}: not an acceptance-trace file (needs arrays 'conf' and 'n_acc')")
            return AcceptanceTraces(z["conf"], z["n_acc"])


def from_rollouts(logits, n_acc, calibration: Calibration | None = None) -> AcceptanceTraces:
    """Traces from recorded raw confidence logits [M, γ] and n_acc [M], calibrated with ``calibration`` (STS)."""
    cal = calibration or Calibration.identity(np.shape(logits)[1])
    return AcceptanceTraces(cal.apply(np.asarray(logits, dtype=np.float64)), np.asarray(n_acc))


def synthetic_traces(
    n_rounds: int = 20_000, gamma: int = 7, *, alpha: float = 4.0, beta: float = 1.0, seed: int = 0
) -> AcceptanceTraces:
    """Perfectly calibrated synthetic rounds: per slot an acceptance probability p_k ~ Beta(alpha, beta) (mean
    alpha/(alpha+beta), 0.8 by default), confidence c_k = p_k, and acceptance drawn as a left-to-right Bernoulli
    chain — so E[1{n_acc >= k} | c] = prod_{i<=k} c_i exactly, as calibration is supposed to achieve.
    The default gives τ ≈ 4.2 at γ = 7, between the paper's chat and math numbers."""
    rng = np.random.default_rng(seed)
    p = rng.beta(alpha, beta, size=(n_rounds, gamma))
    ok = rng.random((n_rounds, gamma)) < p  # [M, γ] would slot k be accepted given all before it were
    n_acc = np.cumprod(ok, axis=1).sum(axis=1)  # leading run of acceptances
    return AcceptanceTraces(p, n_acc)
