"""Online correction of calibrated confidences against the acceptance the engine actually sees.

STS calibration is fitted offline on a held-out prompt set; live traffic is another distribution. On the
`bench serve` mix the 2,400-step drafter's calibrated slot confidences ran ~11 % above the acceptance measured
(slot 1: 0.368 predicted, 0.330 accepted; `scripts/engine_step_times.py --confidence`), and a top-K scheduler
admits exactly the slots whose confidence is most over-estimated, so it drafts where drafting loses.

Every verified slot is a labelled example: slot j of request r was *tested* when j < ℓ_r and every earlier slot
was accepted (j <= a_r), and it passed when j < a_r. The tracker keeps exponentially decayed sums of predicted
c[r, j] and of passes over tested slots; their ratio (bounded, starting from a prior of 1) scales the
confidences the scheduler sees.

Lossless: the ratio used at step t is a function of steps before t only (their tokens are committed), so the
decision about slot j still never looks at tokens sampled at slot j or later (DESIGN.md invariant 3). A constant
scale also keeps the survival non-increasing along j, so admissions stay prefixes. Outcomes are a function of
the seeded draws, not of timing, so seeded runs stay reproducible.
"""
from __future__ import annotations

import numpy as np


class AcceptanceTracker:
    def __init__(self, halflife: float = 2000.0, prior: float = 50.0, bounds: tuple[float, float] = (0.5, 1.5)):
        """halflife: tested slots after which an outcome counts half; prior: pseudo-slots at ratio 1;
        bounds: the ratio is clipped to these (one bad stretch must not switch speculation off for good)."""
        if halflife <= 0 or prior <= 0 or not 0 < bounds[0] <= 1 <= bounds[1]:
            raise ValueError(f"need halflife > 0, prior > 0 and 0 < low <= 1 <= high, got {halflife}, {prior}, "
                             f"{bounds}")
        self.halflife, self.prior, self.bounds = halflife, prior, bounds
        self.reset()

    def reset(self) -> None:
        self.predicted = self.passed = self.prior  # decayed sums over tested slots (prior: ratio 1)
        self.tested = 0  # slots seen (not decayed), for reports

    @property
    def ratio(self) -> float:
        return float(np.clip(self.passed / self.predicted, *self.bounds))

    def adjust(self, c):
        """Confidences [..., γ] scaled by the current ratio (clipped to [0, 1]); None passes through."""
        if c is None:
            return None
        return np.clip(np.asarray(c, dtype=np.float64) * self.ratio, 0.0, 1.0)

    def update(self, c, lengths, accepted) -> None:
        """c: [R, γ] the (unadjusted) confidences of a verified step; lengths: [R] ℓ_r verified; accepted: [R]."""
        c = np.asarray(c, dtype=np.float64)
        if c.size == 0:
            return
        lengths = np.asarray(lengths).reshape(-1, 1)
        accepted = np.asarray(accepted).reshape(-1, 1)
        j = np.arange(c.shape[1])[None, :]
        tested = (j < lengths) & (j <= accepted)  # [R, γ]
        n = int(tested.sum())
        if not n:
            return
        keep = 0.5 ** (n / self.halflife)
        self.predicted = self.predicted * keep + float(c[tested].sum())
        self.passed = self.passed * keep + float((j < accepted)[tested].sum())
        self.tested += n
