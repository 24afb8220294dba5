"""The async scheduler's probing under load, where a probe drafts fewer requests than the batch holds:
``confirm`` (a promising pool thinner than the batch is re-probed before every request drafts), ``steady_run``
(a drafting run that ends at once keeps the backed-off probe interval) and the far back-off (probes rarer than
``max_probe_every`` while drafting is priced far from paying), ``watch_load`` (soon again once the load halves)
and ``hold_backoff`` (a one-request dip does not restart the back-off). All read only past decisions, old
confidences and request counts; the engine-level exactness of every async variant is in
tests/drafters/test_dspark_exactness.py."""
import numpy as np
import pytest

from dspark.scheduling.async_policy import AsyncPolicy
from dspark.scheduling.registry import make_policy


def _priced_for(n_requests: int):
    """Plain decoding at 1 step/s; any drafts slow the step to 1/1.4: K > 0 pays only for confident drafts."""
    return lambda b: np.where(np.asarray(b) > n_requests, 1 / 1.4, 1.0)


def _serve(pol: AsyncPolicy, n_requests: int, steps: int, confidence) -> list[tuple[int | None, int]]:
    """(K, requests drafted) of each step; confidence(step, probing) is what every drafted slot shows."""
    seen = []
    for step in range(steps):
        drafts = pol.prepare(n_requests)
        n = pol.requests_to_draft(n_requests) if drafts else 0
        seen.append((pol.last_capacity, n))
        if not drafts:
            pol.select(None, n_requests=n_requests)
            continue
        c = np.zeros((n_requests, 3))
        c[:n] = confidence(step, pol._probing)
        pol.select(c, drafted=list(range(n)) if n < n_requests else None)
    return seen


def test_confirm_reprobes_a_thin_promising_pool_before_drafting_for_every_request():
    """Four requests, probes of two: a probe's two strong rows price K > 0 for all four. Without confirm the
    next step drafts all four on that evidence; with it, a second probe runs first, and K > 0 comes once the pool
    holds four rows."""
    def policy(**kw):
        return AsyncPolicy(_priced_for(4), min_gain=0.1, pool_requests=8, probe_every=2, max_age=4, **kw)

    strong_after_start = lambda step, probing: 0.1 if step < 2 else 0.9  # noqa: E731
    plain = _serve(policy(confirm=0), 4, 10, strong_after_start)
    confirmed = _serve(policy(confirm=1), 4, 10, strong_after_start)
    # steps 0-1: no history (Algorithm 1, all drafted); 2-3 weak: skipped; 4: the probe (two requests)
    assert plain[:6] == confirmed[:6] == [(None, 4), (None, 4), (0, 0), (0, 0), (None, 2), (0, 0)]
    assert plain[6] == (12, 4)  # K from the probe's two rows alone
    # step 6 probes again; step 7 still sees only the first probe and waits (no second confirmation of it);
    # step 8 pools both probes: four rows for four requests
    assert confirmed[6:9] == [(None, 2), (0, 0), (12, 4)]


def test_confirm_that_turns_weak_keeps_the_drafter_off():
    """A lucky probe (0.45) among weak drafts (0.05): alone its two rows price K > 0 for four requests, pooled
    with the confirming probe's weak rows they do not."""
    def policy(**kw):
        return AsyncPolicy(_priced_for(4), min_gain=0.1, pool_requests=8, probe_every=2, max_age=4, **kw)

    lucky_once = lambda step, probing: 0.45 if step == 4 else 0.05  # noqa: E731
    plain, confirmed = _serve(policy(confirm=0), 4, 14, lucky_once), _serve(policy(confirm=1), 4, 14, lucky_once)
    assert plain[6:8] == [(12, 4), (12, 4)]  # two steps draft all four on the lucky rows
    assert confirmed[6] == (None, 2) and all(n <= 2 for _, n in confirmed[2:])  # no step drafts all four


def test_confirm_changes_nothing_when_a_probe_drafts_the_whole_batch():
    for n_requests in (1, 2):
        runs = [_serve(AsyncPolicy(_priced_for(n_requests), min_gain=0.1, probe_every=2, max_age=4, **kw),
                       n_requests, 24, lambda step, probing: 0.9 if probing else 0.1)
                for kw in ({}, {"confirm": 1})]
        assert runs[0] == runs[1]


def test_a_false_start_keeps_the_backed_off_probe_interval_with_steady_run():
    """Three requests, probes of two that look strong, drafting steps that turn out weak: each drafting run
    lasts two steps. By default every run resets the interval, so the probes never back off; with steady_run = 4
    a run that short keeps the interval, which goes on doubling."""
    def probes(**kw):
        pol = AsyncPolicy(_priced_for(3), min_gain=0.1, pool_requests=1, probe_every=2, max_probe_every=64, **kw)
        seen = _serve(pol, 3, 40, lambda step, probing: 0.9 if probing else 0.1)
        return [step for step, (k, _) in enumerate(seen) if k is None and step >= 2]

    assert np.diff(probes()).tolist() == [6] * (len(probes()) - 1)
    steady = probes(steady_run=4)
    assert steady[:3] == [4, 12, 24] and len(steady) < len(probes())


def _probe_steps(pol: AsyncPolicy, loads: list[int], confidence: float) -> list[int]:
    """Steps that probed while the batch held loads[step] requests and every drafted slot showed `confidence`."""
    probes = []
    for step, n_requests in enumerate(loads):
        if not pol.prepare(n_requests):
            pol.select(None, n_requests=n_requests)
            continue
        n = pol.requests_to_draft(n_requests)
        if pol.last_capacity is None and step >= 2:
            probes.append(step)
        c = np.zeros((n_requests, 3))
        c[:n] = confidence
        pol.select(c, drafted=list(range(n)) if n < n_requests else None)
    return probes


def _far_policy(far_probe_every: int = 32, priced_for: int = 3, **kw) -> AsyncPolicy:
    return AsyncPolicy(_priced_for(priced_for), min_gain=0.1, pool_requests=1, probe_every=2, max_probe_every=8,
                       far_probe_every=far_probe_every, **kw)


def test_probes_back_off_past_the_cap_only_while_drafting_is_priced_far_from_paying():
    """Three requests, probes of two. Slots at 0.05 price the best K at ~0.75 of plain decoding (far: the
    interval doubles on to far_probe_every); at 0.25 at ~0.95 (near enough that the cap stays max_probe_every)."""
    far = _probe_steps(_far_policy(), [3] * 200, 0.05)
    # steps 0-1 draft (no history), 2-3 skip, 4 probes; then 4, 8, 16, 32, 32 skipped steps between probes
    assert far[0] == 4 and np.diff(far).tolist()[:5] == [5, 9, 17, 33, 33]
    near = _probe_steps(_far_policy(), [3] * 200, 0.25)
    assert set(np.diff(near).tolist()[3:]) == {9}  # capped at 8 skipped steps
    assert np.diff(_probe_steps(_far_policy(far_probe_every=8), [3] * 200, 0.05)).tolist() == np.diff(near).tolist()


def test_probes_come_soon_again_once_the_load_halves_after_a_far_back_off():
    """At four requests the far back-off reaches 32 skipped steps (probes at steps 35, 68, 101, ...); when the
    batch falls to two at step 70 (half the four it held when the interval passed the cap) the next probe comes
    after probe_every = 2 skipped steps, not at step 101. A dip to three does not bring it forward."""
    halved = _probe_steps(_far_policy(priced_for=4), [4] * 70 + [2] * 40, 0.05)
    assert [s for s in halved if s <= 70][-3:] == [18, 35, 68]
    assert min(s for s in halved if s > 70) == 71  # 68 probed, 69-70 skipped: two in a row
    dip = _probe_steps(_far_policy(priced_for=4), [4] * 70 + [3] * 40, 0.05)
    assert min(s for s in dip if s > 70) == 101


def test_probes_come_soon_again_once_the_load_halves_below_the_cap():
    """Without the far back-off: at four requests probes back off to the 8-step cap (one in 9 steps, at 36, 45,
    54, 63); when the batch falls to two at step 65 the next probe comes after probe_every = 2 skipped steps
    (step 66), where without watch_load it waits for the cap (step 72). A dip to three moves nothing."""
    def probes(loads, **kw):
        return _probe_steps(_far_policy(far_probe_every=8, priced_for=4, **kw), loads, 0.05)

    before = [s for s in probes([4] * 65) if s > 30]
    assert before == [36, 45, 54, 63]
    assert min(s for s in probes([4] * 65 + [2] * 20) if s > 63) == 66
    assert min(s for s in probes([4] * 65 + [2] * 20, watch_load=0) if s > 63) == 72
    assert min(s for s in probes([4] * 65 + [3] * 20) if s > 63) == 72


def test_probing_options_are_validated_and_reachable_by_name():
    pol = make_policy("async:confirm=1:steady_run=4:far_loss=0.3:far_probe_every=128:watch_load=0",
                      sps=_priced_for(1))
    assert pol.confirm is True and pol.steady_run == 4 and pol.far_loss == 0.3 and pol.far_probe_every == 128
    assert pol.watch_load is False
    for bad in ({"confirm": 2}, {"steady_run": 0}, {"far_loss": 0.0}, {"far_loss": 1.0},
                {"far_probe_every": 32}, {"watch_load": 2}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            AsyncPolicy(_priced_for(1), **bad)


def test_a_probe_at_low_load_drafts_one_slot_past_the_depth_last_priced():
    """One request whose drafts turn weak: once the drafter is skipped, each probe drafts the depth the pool
    last priced plus one (what Algorithm 1 can use there), not the whole block; with shallow_probes=0 the whole
    block. Before any pool exists the first steps still draft it all."""
    from dspark.scheduling.profile import SpeedProfile

    prof = SpeedProfile((1, 4, 8), (1.0, 1.1, 1.3), (1, 4), (0.05, 0.08), shallow_draft_seconds=(0.02, 0.03),
                        draft_depth=7)

    def probe_depths(**kw):
        pol, seen = AsyncPolicy(prof, explore_every=1000, **kw), []
        for step in range(80):
            drafts = pol.prepare(1)
            depth = pol.draft_depth(7) if drafts else 0
            seen.append((pol.last_capacity, depth, pol._depth))
            c = np.full((1, depth), 0.9 if step < 20 else 0.02)
            pol.select(c if drafts else None, n_requests=1)
        return seen

    shallow, whole = probe_depths(), probe_depths(shallow_probes=0)
    assert shallow[0][:2] == whole[0][:2] == (None, 7)  # no pool yet: Algorithm 1 over the whole block
    probes = [(depth, priced) for k, depth, priced in shallow[20:] if k is None]
    assert len(probes) >= 3 and all(depth == priced + 1 < 7 for depth, priced in probes)
    assert all(depth == 7 for k, depth, _ in whole[20:] if k is None)
    with pytest.raises(ValueError, match="shallow_probes"):
        AsyncPolicy(prof, shallow_probes=2)


def test_k_margin_is_validated_and_reachable_by_name():
    """(What it decides is tested with capacity_and_depth's brute-force reference in test_sched_policies.py.)"""
    assert make_policy("async:k_margin=0", sps=_priced_for(1)).k_margin == 0.0
    assert AsyncPolicy(_priced_for(1)).k_margin == 0.0 and make_policy("async:k_margin=0.02",
                                                                       sps=_priced_for(1)).k_margin == 0.02
    for bad in (-0.01, 1.0):
        with pytest.raises(ValueError, match="k_margin"):
            AsyncPolicy(_priced_for(1), k_margin=bad)


def test_a_dip_of_one_request_keeps_the_probes_backed_off_with_hold_backoff():
    """Two requests, where drafting loses (each token past two costs 0.4 of a step), with a dip to one request
    every 20 steps (one left, the next not yet in), where one draft is free and K = 1 pays. Without hold_backoff
    each dip's drafting step resets the probes' interval, so they start again from two skipped steps every 20;
    with it they stay backed off. A dip that lasts DIP_STEPS drafting steps is a load drop, and resets them as
    before."""
    from dspark.scheduling.async_policy import DIP_STEPS

    free_second_token = lambda b: 1 / (1 + 0.4 * np.maximum(np.asarray(b) - 2, 0))  # noqa: E731

    def probes(loads, **kw):
        pol = AsyncPolicy(free_second_token, min_gain=0.1, pool_requests=1, probe_every=2, max_probe_every=32, **kw)
        return [s for s in _probe_steps(pol, loads, 0.3) if loads[s] == 2]

    dips = ([2] * 19 + [1]) * 10
    held, reset = probes(dips), probes(dips, hold_backoff=0)
    assert len(reset) >= 2 * len(held) and len(held) <= 8, (held, reset)
    drop = [2] * 60 + [1] * DIP_STEPS + [2] * 20  # a lasting drop: the interval resets, probes come soon again
    assert min(s for s in probes(drop) if s > 60) == min(s for s in probes(drop, hold_backoff=0) if s > 60)
    assert make_policy("async:hold_backoff=0", sps=free_second_token).hold_backoff is False
    with pytest.raises(ValueError, match="hold_backoff"):
        AsyncPolicy(free_second_token, hold_backoff=2)
