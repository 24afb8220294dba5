"""scheduling/engine_work.py: the engine's commit and feed fitted as lines from timed steps, and added to a profile."""
import dataclasses

import pytest

from dspark.scheduling.engine_work import EngineWork, StepSample, fit, priced_in
from dspark.scheduling.profile import SpeedProfile
from dspark.scheduling.profile_io import load_cached_profile, save_profile

PROFILE = SpeedProfile((1, 4, 16), (0.030, 0.040, 0.080), (1, 4), (0.008, 0.012), shallow_draft_seconds=(0.005, 0.007),
                       draft_depth=7, grid_requests=(1, 4), grid_tokens=(1, 2, 4), segment_seconds=0.002,
                       tokens_per_segment=4, grid_seconds=((0.030, 0.036, 0.042), (0.040, 0.060, 0.080)),
                       prefill_requests=(0, 1), prefill_tokens=(16, 64), prefill_seconds=((0.03, 0.05), (0.04, 0.06)),
                       source="measured")
TRUE = EngineWork(commit_s=4e-4, commit_request_s=1e-4, verify_s=3e-4, verify_draft_s=5e-5, feed_s=6e-4,
                  feed_request_s=9e-5, draft_factor=1.2)


def steps(work: EngineWork, noise: float = 0.0) -> list[StepSample]:
    """Steps at 1 and 4 requests verifying 1, 2 or 4 tokens each, timed as ``work`` says, every tenth one stalled
    by ``noise`` seconds (a median ignores it)."""
    out = []
    for r in (1, 4):
        for k in (1, 2, 4):
            for i in range(21):
                drafts, drafted = r * (k - 1), r if k > 1 else 0
                stall = noise if i % 10 == 0 else 0.0
                out.append(StepSample(r, r * k, work.step_s(r, drafts) + stall, drafted, k if drafted else 0,
                                      work.draft_factor * float(PROFILE.draft_s(r, k)) + stall if drafted else 0.0,
                                      work.feed(r) + stall if drafted else 0.0))
    return out


def test_fit_recovers_the_lines_the_steps_were_timed_by():
    got = fit(steps(TRUE, noise=0.05), PROFILE)
    for f in dataclasses.fields(EngineWork):
        assert getattr(got, f.name) == pytest.approx(getattr(TRUE, f.name), rel=1e-6, abs=1e-12), f.name


def test_fit_never_prices_work_below_nothing_and_one_load_has_no_slope():
    shrinking = [StepSample(1, 1, 1e-3), StepSample(4, 4, 5e-4)]  # more requests, less commit: noise
    work = fit(shrinking, PROFILE)
    assert work.commit_request_s == 0.0 and work.commit_s == pytest.approx(7.5e-4)
    one_load = fit([StepSample(2, 2, 1e-3), StepSample(2, 4, 1.4e-3, 2, 2, 0.004, 5e-4)], PROFILE)
    assert (one_load.commit_s, one_load.commit_request_s) == (pytest.approx(1e-3), 0.0)
    assert (one_load.verify_s, one_load.verify_draft_s) == (pytest.approx(4e-4), 0.0)
    assert (one_load.feed_s, one_load.feed_request_s) == (pytest.approx(5e-4), 0.0)
    assert fit([], PROFILE) == EngineWork()  # nothing measured: nothing added


def test_priced_in_adds_seconds_to_every_table():
    prof = priced_in(PROFILE, TRUE)
    for r in (1, 4):
        for k in (1, 2, 4):
            want = float(PROFILE.step_s(r * k, n_requests=r)) + TRUE.step_s(r, r * (k - 1))
            assert prof.step_s(r * k, n_requests=r) == pytest.approx(want)
        for depth in (1, 3, 7):
            assert prof.draft_s(r, depth) == pytest.approx(1.2 * float(PROFILE.draft_s(r, depth)) + TRUE.feed(r))
    # the B-table (no request count): B // 4 requests verifying the rest as drafts
    assert prof.step_s(16) == pytest.approx(0.080 + TRUE.step_s(4, 12))
    assert prof.segment_seconds == pytest.approx(0.002 + 1e-4)
    # a prompt's own extra time is what was measured; the decoding request beside it pays its commit
    assert prof.prefill_extra_s(64, 1) == pytest.approx(PROFILE.prefill_extra_s(64, 1))
    assert prof.step_s(1, n_requests=1, prefill=(64,)) == pytest.approx(
        float(PROFILE.step_s(1, n_requests=1, prefill=(64,))) + TRUE.step_s(1, 0))
    assert "engine work: commit 0.400 + 0.100/request ms" in prof.source


def test_a_priced_profile_survives_the_cache(tmp_path):
    prof = dataclasses.replace(priced_in(PROFILE, TRUE), key=None)
    assert load_cached_profile(save_profile(prof, tmp_path / "p.json"), None) == prof


@pytest.mark.parametrize("bad", [{"commit_s": -1e-3}, {"draft_factor": 0.0}, {"feed_s": float("nan")},
                                 {"verify_draft_s": "1"}])
def test_engine_work_rejects_what_is_not_a_price(bad):
    with pytest.raises(ValueError, match="EngineWork"):
        EngineWork(**bad)
