"""engine/overhead.py: a fresh speed profile gets the engine's own work (commit, feed, the proposal beside a forward)
priced in, from a short run of the real engine at two loads."""
import pytest

from dspark.engine import overhead
from dspark.scheduling.engine_work import EngineWork
from dspark.scheduling.profile import SpeedProfile
from dspark_testlib import tiny_drafter, tiny_target

PROFILE = SpeedProfile((1, 4, 16), (0.030, 0.040, 0.080), (1, 4), (0.008, 0.012), shallow_draft_seconds=(0.005, 0.007),
                       draft_depth=7, grid_requests=(1, 4), grid_tokens=(1, 2, 4),
                       grid_seconds=((0.030, 0.036, 0.042), (0.040, 0.060, 0.080)), source="measured")


def test_the_engine_run_times_every_step_kind_at_both_loads(monkeypatch):
    monkeypatch.setattr(overhead, "STEPS", 6)
    target = tiny_target(seed=3)
    samples = overhead.engine_steps(target, tiny_drafter(target, head="markov", block=4))
    shapes = {(s.n_requests, s.n_tokens // s.n_requests, bool(s.drafted)) for s in samples}
    # plain decoding (the drafter skipped), MTP-1 (2 tokens a request) and fixed-3 (4), at 1 and 4 requests
    assert {(r, k, k > 1) for r in overhead.REQUESTS for k in (1, 2, 4)} <= shapes
    assert all(s.commit_s > 0 for s in samples)
    assert all(s.draft_s > 0 and s.feed_s >= 0 and s.depth >= 1 for s in samples if s.drafted)
    work = overhead.engine_work(target, tiny_drafter(target, head="markov", block=4), PROFILE)
    assert work.commit_s + work.commit_request_s > 0 and work.draft_factor > 0


def test_calibration_adds_the_fitted_work_to_the_profile(monkeypatch):
    work = EngineWork(commit_s=1e-3, commit_request_s=2e-4, verify_s=5e-4, verify_draft_s=1e-4, feed_s=3e-4,
                      feed_request_s=1e-4, draft_factor=1.5)
    monkeypatch.setattr(overhead, "engine_work", lambda *a, **kw: work)
    target = tiny_target(seed=3)
    prof = overhead.calibrated(target, tiny_drafter(target, block=4), PROFILE)
    assert prof.step_s(1, n_requests=1) == pytest.approx(0.030 + 1e-3 + 2e-4)  # plain: the commit only
    assert prof.step_s(4, n_requests=1) == pytest.approx(0.042 + 1.2e-3 + 5e-4 + 3 * 1e-4)  # + 3 drafts verified
    assert prof.draft_s(4) == pytest.approx(0.012 * 1.5 + 3e-4 + 4 * 1e-4)
    assert prof.source.startswith("measured, engine work: commit 1.000 + 0.200/request ms")


def test_no_drafter_or_no_drafting_table_leaves_the_profile_as_it_is():
    target = tiny_target(seed=3)
    assert overhead.calibrated(target, None, PROFILE) is PROFILE
    plain = SpeedProfile((1, 4), (0.03, 0.04))
    assert overhead.calibrated(target, tiny_drafter(target, block=4), plain) is plain
