"""engine/overhead.py: a fresh speed profile gets the engine's own work (commit, feed) priced in, from a short run
of the real engine, as one factor each for plain steps, verify steps and proposals."""
import math

import pytest

from dspark.engine import overhead
from dspark.scheduling.profile import SpeedProfile
from dspark_testlib import tiny_drafter, tiny_target

PROFILE = SpeedProfile((1, 4, 16), (0.030, 0.040, 0.080), (1, 4), (0.008, 0.012), shallow_draft_seconds=(0.005, 0.007),
                       draft_depth=7, grid_requests=(1, 4), grid_tokens=(1, 2, 4),
                       grid_seconds=((0.030, 0.036, 0.042), (0.040, 0.060, 0.080)), source="measured")


def test_the_engine_run_measures_all_three_step_kinds(monkeypatch):
    monkeypatch.setattr(overhead, "STEPS", 6)
    target = tiny_target(seed=3)
    factors = overhead.engine_factors(target, tiny_drafter(target, head="markov", block=4), PROFILE)
    assert set(factors) == {"plain", "verify", "draft"}
    # 1.0 exactly is what a class without samples gets: every one was measured
    assert all(math.isfinite(f) and f > 0 and f != 1.0 for f in factors.values()), factors


def test_calibration_scales_plain_verify_and_drafting_prices_by_those_factors(monkeypatch):
    monkeypatch.setattr(overhead, "engine_factors", lambda *a, **kw: {"plain": 1.1, "verify": 1.3, "draft": 1.5})
    target = tiny_target(seed=3)
    prof = overhead.calibrated(target, tiny_drafter(target, block=4), PROFILE)
    # the grid's k = 1 column takes the plain factor, the others the verify factor, drafting the draft factor
    assert prof.step_s(1, n_requests=1) == pytest.approx(0.030 * 1.1)
    assert prof.step_s(4, n_requests=1) == pytest.approx(0.042 * 1.3)
    assert prof.draft_s(4) == pytest.approx(0.012 * 1.5)
    assert prof.source == "measured, engine x1.100 plain, x1.300 verify, x1.500 drafting"


def test_no_drafter_or_no_drafting_table_leaves_the_profile_as_it_is():
    target = tiny_target(seed=3)
    assert overhead.calibrated(target, None, PROFILE) is PROFILE
    plain = SpeedProfile((1, 4), (0.03, 0.04))
    assert overhead.calibrated(target, tiny_drafter(target, block=4), plain) is plain
