"""Live step prices (scheduling/live_profile.py): the rescaled profile prices each step class by its own factor,
factors are robust medians that wait for enough samples, and the async scheduler re-prices K from them (the engine's
reports: tests/test_engine.py; exactness under live prices: tests/drafters/test_dspark_exactness.py)."""

import numpy as np
import pytest

from dspark.scheduling.live_profile import LiveProfile, rescaled
from dspark.scheduling.profile import SpeedProfile
from dspark.scheduling.registry import make_policy

# A grid of R = 1, 4 requests verifying k = 1, 2, 4 tokens each, drafting tables at depth 7 and depth 1.
GRID = SpeedProfile((1, 4, 16), (0.030, 0.040, 0.080), (1, 4), (0.008, 0.012), shallow_draft_seconds=(0.005, 0.007),
                    draft_depth=7, grid_requests=(1, 4), grid_tokens=(1, 2, 4),
                    grid_seconds=((0.030, 0.036, 0.042), (0.040, 0.060, 0.080)))


def test_rescaled_prices_plain_verify_and_drafting_steps_by_their_own_factor():
    p = rescaled(GRID, plain=0.5, verify=2.0, draft=3.0)
    for r in (1, 4):
        assert p.step_s(r, n_requests=r) == pytest.approx(0.5 * GRID.step_s(r, n_requests=r))  # k = 1: plain
        for k in (2, 4):
            assert p.step_s(r * k, n_requests=r) == pytest.approx(2.0 * GRID.step_s(r * k, n_requests=r))
    for depth in (1, 4, 7):
        assert p.draft_s(4, depth) == pytest.approx(3.0 * GRID.draft_s(4, depth))
    assert p.step_s(16) == pytest.approx(2.0 * GRID.step_s(16))  # the B-table cannot tell classes apart
    same = rescaled(GRID)
    assert "live" in p.source and (same.grid_seconds, same.draft_seconds) == (GRID.grid_seconds, GRID.draft_seconds)


def test_factors_wait_for_enough_samples_and_ignore_a_stall():
    live = LiveProfile(GRID, window=8, min_samples=4)
    plain = GRID.step_s(1, n_requests=1)
    for _ in range(3):
        live.observe_forward(1, 1, 0.8 * plain)
    assert live.factor("plain") == 1.0 and live.current is GRID  # three samples are not enough
    live.observe_forward(1, 1, 0.8 * plain)
    # No verify step seen yet: no news of the two drifting apart, so verify steps follow the plain ones
    assert live.factors() == pytest.approx({"plain": 0.8, "verify": 0.8, "draft": 1.0})
    assert live.current.step_s(1, n_requests=1) == pytest.approx(0.8 * plain)
    live.observe_forward(1, 1, 5.0 * plain)  # one step stalled on a shared machine
    assert live.factor("plain") == pytest.approx(0.8)
    for _ in range(8):  # the window forgets: the machine sped up
        live.observe_forward(8, 4, 0.5 * GRID.step_s(8, n_requests=4))
        live.observe_draft(4, 7, 1.5 * GRID.draft_s(4, 7))
        live.observe_draft(1, 1, 1.5 * GRID.draft_s(1, 1))
    assert live.factors() == pytest.approx({"plain": 0.8, "verify": 0.5, "draft": 1.5})
    assert live.current.draft_s(2, 3) == pytest.approx(1.5 * GRID.draft_s(2, 3))


def test_old_samples_age_out_and_a_class_without_young_ones_follows_the_other():
    live = LiveProfile(GRID, window=8, min_samples=2, max_age=10)
    plain, verify = GRID.step_s(2, n_requests=2), GRID.step_s(4, n_requests=2)
    for _ in range(2):  # a slow start: the warm-up's plain steps
        live.observe_forward(2, 2, 1.3 * plain)
    for _ in range(8):  # then only verify steps (a scheduler that drafts every step)
        live.observe_forward(4, 2, 0.9 * verify)
    assert live.factors()["plain"] == pytest.approx(1.3)  # 9 reports ago: still young
    live.observe_forward(4, 2, 0.9 * verify)
    assert live.factors() == pytest.approx({"plain": 0.9, "verify": 0.9, "draft": 1.0})  # aged out: follows verify
    for _ in range(2):
        live.observe_forward(2, 2, 1.1 * plain)
    assert live.factors()["plain"] == pytest.approx(1.1)
    for _ in range(10):
        live.observe_draft(2, 3, 0.7 * GRID.draft_s(2, 3))  # drafting reports age the target's samples too
    assert live.factors() == pytest.approx({"plain": 1.0, "verify": 1.0, "draft": 0.7})  # no young target news


def test_current_is_rebuilt_only_when_a_factor_moves_past_the_tolerance():
    live = LiveProfile(GRID, window=4, min_samples=1, tolerance=0.05)
    plain = GRID.step_s(4, n_requests=4)
    live.observe_forward(4, 4, 1.2 * plain)
    first = live.current
    assert live.rebuilds == 1
    live.observe_forward(4, 4, 1.22 * plain)  # median 1.21: within 5 % of 1.2
    assert live.current is first and live.rebuilds == 1
    live.observe_forward(4, 4, 1.5 * plain)
    live.observe_forward(4, 4, 1.5 * plain)  # median 1.36
    assert live.current is not first and live.rebuilds == 2
    live.observe_forward(4, 4, 0.0)  # a clock that did not move says nothing
    assert live.factor("plain") == pytest.approx(np.median([1.2, 1.22, 1.5, 1.5]))
    assert live.factor("verify") == live.factor("plain")  # no verify step seen: it follows the plain ones


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="n_tokens >= n_requests"):
        LiveProfile(GRID).observe_forward(1, 2, 0.1)
    with pytest.raises(ValueError, match="min_samples"):
        LiveProfile(GRID, window=4, min_samples=5)
    with pytest.raises(ValueError, match="max_age"):
        LiveProfile(GRID, min_samples=6, max_age=5)
    with pytest.raises(TypeError, match="measured SpeedProfile"):
        make_policy("async:live=1", sps=lambda b: 1.0)
    with pytest.raises(ValueError, match="live must be a bool"):
        make_policy("async:live=2", sps=GRID)
    no_drafting = LiveProfile(SpeedProfile((1, 8), (0.03, 0.05)), min_samples=1)
    no_drafting.observe_draft(1, 7, 0.5)  # drafting is not priced: nothing to correct
    assert no_drafting.factor("draft") == 1.0


def _k_after(policy, timing, steps, c):
    """K after `steps` drafted steps of confidences `c`, each step's times reported as `timing` gives them (after
    a few plain steps, so that the plain price is measured too)."""
    for _ in range(6):
        policy.observe_step(c.shape[0], c.shape[0], timing.step(c.shape[0], c.shape[0]))
    for _ in range(steps):
        policy.prepare(c.shape[0])
        lengths = policy.select(c)
        n_tokens, depth = int(c.shape[0] + lengths.sum()), policy.draft_depth(c.shape[1])
        policy.observe_step(n_tokens, c.shape[0], timing.step(n_tokens, c.shape[0]), c.shape[0], depth,
                            timing.draft(c.shape[0], depth))
    policy.prepare(c.shape[0])
    return policy.last_capacity


class Timing:
    """A machine whose verify steps and proposals cost `verify` and `draft` times their cached price."""

    def __init__(self, verify: float = 1.0, draft: float = 1.0):
        self.verify, self.draft_factor = verify, draft

    def step(self, n_tokens, n_requests):
        return GRID.step_s(n_tokens, n_requests=n_requests) * (1.0 if n_tokens == n_requests else self.verify)

    def draft(self, n_requests, depth):
        return GRID.draft_s(n_requests, depth) * self.draft_factor


def test_async_reprices_k_from_live_step_times():
    c = np.full((1, 7), 0.5)  # with the cached prices K = 2 pays
    fixed = make_policy("async", sps=GRID)
    assert _k_after(fixed, Timing(verify=3.0), 12, c) == 2  # fixed prices: measured times change nothing
    dear = make_policy("async:live=1", sps=GRID)
    assert _k_after(dear, Timing(verify=3.0), 12, c) == 0  # verify steps at 3x their cached price never pay
    assert dear.live.factors() == pytest.approx({"plain": 1.0, "verify": 3.0, "draft": 1.0})
    cheap = make_policy("async:live=1", sps=GRID)
    assert _k_after(cheap, Timing(verify=0.5, draft=0.5), 12, c) == 2
    # The best K is the same (all verify steps got cheaper alike) but it now beats plain decoding by far more:
    # Θ_K / Θ_0 is what the policy's go / no-go margins compare.
    assert cheap._memo[2] > 1.8 * fixed._memo[2] > 1.8


def test_live_prices_count_the_commit_and_the_feed_unless_told_not_to():
    """With live_overhead (the default) a step's commit adds to its forward's time and the feed to its proposal's;
    without it they are left out, as before session 43."""
    def factors(**kw):
        policy = make_policy("async:live=1", sps=GRID, **kw)
        for _ in range(6):  # min_samples
            policy.observe_step(2, 2, GRID.step_s(2, n_requests=2), commit_s=GRID.step_s(2, n_requests=2))
            policy.observe_step(6, 2, GRID.step_s(6, n_requests=2), 2, 3, GRID.draft_s(2, 3),
                                commit_s=GRID.step_s(6, n_requests=2), feed_s=GRID.draft_s(2, 3))
        return [policy.live.factor(c) for c in ("plain", "verify", "draft")]

    assert factors() == pytest.approx([2.0, 2.0, 2.0])
    assert factors(live_overhead=0) == pytest.approx([1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="live_overhead"):
        make_policy("async:live=1:live_overhead=2", sps=GRID)
