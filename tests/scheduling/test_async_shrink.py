"""The async scheduler's ``shrink``: at low load each pooled step's survivals move toward their long-run mean
(``scheduling/long_run.py``). The mean folds a step in only once it is ``lag`` steps old, as the pools do; the
engine-level exactness of the rule is in tests/drafters/test_dspark_exactness.py."""
import numpy as np
import pytest

from dspark.scheduling.async_policy import AsyncPolicy
from dspark.scheduling.depth_pricing import capacity_and_depth, depth_survivals
from dspark.scheduling.long_run import LongRunSurvivals
from dspark.scheduling.profile import SpeedProfile

# every verified token costs 1 ms on a 10 ms step, a drafted slot 0.5 ms: deep drafts pay only when confident
PRICED = SpeedProfile((1, 64), (0.010, 0.073), (1, 16), (0.0005, 0.0005), shallow_draft_seconds=(0.0005, 0.0005),
                      draft_depth=7)


def test_long_run_mean_folds_steps_lag_old_and_keeps_a_window():
    long = LongRunSurvivals(window=2, lag=2)
    steps = [depth_survivals(np.array([[x, x]])) for x in (0.2, 0.4, 0.8)]
    for i, m in enumerate(steps):
        long.add(i, m)
    long.advance(2)  # step 2 may read steps 0 only
    assert long.folded == 1
    np.testing.assert_allclose(long.shrunk(steps[2], 0.0), steps[0])
    long.advance(4)  # steps 0..2 folded, the window keeps 1 and 2
    assert long.folded == 3
    np.testing.assert_allclose(long.shrunk(steps[0], 0.0), (steps[1] + steps[2]) / 2)
    half = long.shrunk(steps[0], 0.5)
    np.testing.assert_allclose(half, 0.5 * steps[0] + 0.25 * (steps[1] + steps[2]))
    np.testing.assert_allclose(long.shrunk(steps[0], 1.0), steps[0], rtol=1e-12)


def test_long_run_mean_counts_each_depth_over_the_steps_that_drafted_it():
    """A shallow step adds to the mean of its own depths only; a depth no step reached is left as it is, and a
    step of another batch size is not mixed in."""
    long = LongRunSurvivals(window=8, lag=1)
    long.add(0, depth_survivals(np.array([[0.5, 0.5, 0.5]])))
    long.add(1, depth_survivals(np.array([[0.9]])))
    long.add(2, depth_survivals(np.array([[0.1, 0.1], [0.1, 0.1]])))  # R = 2
    long.advance(3)
    deep = depth_survivals(np.array([[0.3, 0.3, 0.3, 0.3]]))
    got = long.shrunk(deep, 0.0)
    np.testing.assert_allclose(got[0, :1], [0.7])  # depth 1: both steps
    np.testing.assert_allclose(got[2, :3], [0.5, 0.25, 0.125])  # depth 3: the deep step alone
    np.testing.assert_array_equal(got[3], deep[3])  # depth 4: no step reached it
    assert np.all(np.diff(got[2, :3]) <= 0)
    with pytest.raises(ValueError, match="window"):
        LongRunSurvivals(window=0, lag=2)


def _serve(pol: AsyncPolicy, confidences: list[float]) -> list[int | None]:
    """One request; every drafted slot of step i shows confidences[i]. Returns each step's K."""
    ks = []
    for x in confidences:
        drafts = pol.prepare(1)
        ks.append(pol.last_capacity)
        pol.select(np.full((1, pol.draft_depth(7)), x) if drafts else None, n_requests=1)
    return ks


def test_a_burst_of_confident_steps_moves_k_less_when_shrunk():
    """After 60 steps at confidence 0.3 come 20 at 0.9 (exploring a slot deeper every other drafting step): the
    pools alone follow the burst to deep K, a shrunk pool less far; with shrink 0 K is what the long-run mean
    prices, exactly."""
    run = [0.3] * 60 + [0.9] * 20
    plain, half, zero = (AsyncPolicy(PRICED, min_gain=0.0, explore_every=2, shrink=s) for s in (1.0, 0.5, 0.0))
    k_plain, k_half, k_zero = _serve(plain, run), _serve(half, run), _serve(zero, run)
    assert k_plain[59] == k_half[59] == k_zero[59] == 1  # the long, steady stretch prices alike either way
    assert k_plain[-1] >= k_half[-1] > k_zero[-1] >= 1 and k_plain[-1] >= k_zero[-1] + 2
    zero.prepare(1)  # the next step: its pool, each step of it replaced by the long-run mean, prices its K
    _, pool = zero._old_confidences()
    means = [zero._long.shrunk(d, 0.0) for _, _, d in pool]
    assert zero.last_capacity == capacity_and_depth(means, [1] * len(means), PRICED, 1, margin=zero.k_margin)[0]


def test_shrink_reads_only_steps_lag_old():
    """At every prepare the mean holds exactly the drafted steps at least ``lag`` steps before it."""
    pol = AsyncPolicy(PRICED, min_gain=0.0, shrink=0.25, lag=3)
    drafted = []
    for step in range(30):
        drafts = pol.prepare(1)
        assert pol._long.folded == sum(s <= step - 3 for s in drafted)
        if drafts:
            drafted.append(step)
        pol.select(np.full((1, pol.draft_depth(7)), 0.6) if drafts else None, n_requests=1)


def test_shrink_options_are_validated():
    for bad, match in ((dict(shrink=-0.1), "shrink"), (dict(shrink=1.5), "shrink"), (dict(long_steps=0), "long_steps")):
        with pytest.raises(ValueError, match=match):
            AsyncPolicy(PRICED, **bad)
    assert AsyncPolicy(PRICED)._long is None  # 1: off, nothing kept
