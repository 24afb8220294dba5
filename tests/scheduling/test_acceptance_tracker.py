"""Online calibration: the tracker learns accepted / predicted on tested slots; async uses it losslessly."""
import numpy as np
import pytest

from dspark.scheduling.acceptance_tracker import AcceptanceTracker
from dspark.scheduling.profile import SpeedProfile
from dspark.scheduling.registry import AsyncPolicy, make_policy


def test_only_tested_slots_count():
    t = AcceptanceTracker(prior=1e-9, halflife=1e9)
    c = np.array([[0.5, 0.5, 0.5], [0.8, 0.4, 0.2], [0.9, 0.9, 0.9]])
    # request 0: ℓ 3, 1 accepted -> slots 0 (pass), 1 (fail) tested; request 1: ℓ 2, 2 accepted -> slots 0, 1 pass;
    # request 2: ℓ 0 -> nothing tested
    t.update(c, [3, 2, 0], [1, 2, 0])
    assert t.tested == 4
    assert t.predicted == pytest.approx(0.5 + 0.5 + 0.8 + 0.4)
    assert t.passed == pytest.approx(3.0)
    assert t.ratio == pytest.approx(3 / 2.2)
    t.update(np.zeros((0, 3)), [], [])  # an empty step changes nothing
    assert t.tested == 4


def test_ratio_converges_to_true_over_predicted_and_is_bounded():
    rng = np.random.default_rng(0)
    t = AcceptanceTracker()
    assert t.ratio == 1.0 and t.adjust(None) is None
    for _ in range(3000):  # drafter 25 % over-confident: true acceptance is 0.8 x its confidence
        c = rng.uniform(0.2, 0.9, size=(4, 3))
        passed = rng.uniform(size=c.shape) < 0.8 * c
        accepted = np.cumprod(passed, axis=1).sum(axis=1)
        t.update(c, [3, 3, 3, 3], accepted)
    assert t.ratio == pytest.approx(0.8, abs=0.03)
    np.testing.assert_allclose(t.adjust([[0.5, 1.0]]), [[0.5 * t.ratio, t.ratio]])
    hopeless = AcceptanceTracker(prior=0.1)
    hopeless.update(np.full((1, 3), 0.9), [3], [0])
    assert hopeless.ratio == 0.5  # the lower bound: one bad stretch cannot switch speculation off for good
    with pytest.raises(ValueError, match="halflife"):
        AcceptanceTracker(bounds=(1.2, 1.5))


def test_async_policy_scales_confidences_by_what_it_observed():
    prof = SpeedProfile((1, 4, 8), (1.0, 1.25, 1.6), (1, 8), (0.2, 0.2))
    c = np.full((1, 7), 0.6)
    online, offline = make_policy("async-online", sps=prof), AsyncPolicy(prof)
    assert (online.name, offline.name) == ("async-online", "async")
    online.tracker = AcceptanceTracker(prior=1.0)  # a weak prior, so 40 steps are enough to move it
    for pol in (online, offline):
        for _ in range(40):  # every verified slot rejected: the drafter is far more confident than it should be
            pol.prepare(1)
            ell = pol.select(c)
            pol.observe_outcomes(c, ell, np.zeros_like(ell))
    assert online.tracker.ratio == 0.5 and offline.tracker is None
    online.prepare(1), offline.prepare(1)
    assert online.last_capacity < offline.last_capacity
    online.reset()
    assert online.tracker.ratio == 1.0
