"""Policies: hand-worked cases (ties, early stop), vectorised == per-item loop reference, registry and errors."""

import numpy as np
import pytest

from dspark.scheduling import (
    CONFIDENCE_FREE,
    AsyncPolicy,
    POLICIES,
    ConfidenceRequiredError,
    SpeedProfile,
    async_capacity,
    async_schedule,
    fixed_k,
    gpu_like_profile,
    make_policy,
    static_threshold,
    survival,
    sync_prefix_schedule,
    sync_prefix_schedule_unsafe_no_early_stop,
)
from dspark.scheduling.policies import as_confidences, top_k_lengths


def table_sps(table):
    """SPS from a dict B -> steps/s; raises on arrays, so it also exercises the scalar fallback path."""
    return lambda b: table[int(b)]


# ---------------------------------------------------------------- reference implementations (plain loops)


def ref_survival(c):
    a = np.empty_like(c)
    for r in range(c.shape[0]):
        run = 1.0
        for j in range(c.shape[1]):
            run = run * c[r, j]
            a[r, j] = run
    return a


def ref_sync(c, sps, early_stop=True):
    """Algorithm 1 exactly as written in the paper, one item at a time."""
    R, G = c.shape
    a = ref_survival(c)
    items = sorted((-a[r, j], j, r) for r in range(R) for j in range(G))
    ell, B, tau = [0] * R, R, float(R)
    best, best_ell = R * sps(R), list(ell)
    for neg_a, j, r in items:
        assert ell[r] == j, "visit order must reach slot j of a request right after slot j-1"
        ell[r], B, tau = j + 1, B + 1, tau + (-neg_a)
        theta = tau * sps(B)
        if theta > best:
            best, best_ell = theta, list(ell)
        elif early_stop:
            break
    return np.array(best_ell)


def ref_capacity(c, sps, base, theta0=None):
    a = ref_survival(c)
    vals = sorted((-a[r, j], j, r) for r in range(c.shape[0]) for j in range(c.shape[1]))
    tau, best, k_best = float(base), base * sps(base) if theta0 is None else theta0, 0
    for n, (neg_a, _, _) in enumerate(vals, start=1):
        tau += -neg_a
        theta = tau * sps(base + n)
        if theta > best:
            best, k_best = theta, n
    return k_best


def ref_topk(c, k):
    a = ref_survival(c)
    items = sorted((-a[r, j], j, r) for r in range(c.shape[0]) for j in range(c.shape[1]))
    ell = np.zeros(c.shape[0], dtype=int)
    for _, j, r in items[:k]:
        assert ell[r] == j
        ell[r] += 1
    return ell


# ---------------------------------------------------------------- hand-worked cases

C2 = np.array([[0.9, 0.5], [0.8, 0.9]])  # a = [[0.9, 0.45], [0.8, 0.72]]; order (0,0) (1,0) (1,1) (0,1)


def test_survival():
    np.testing.assert_allclose(survival(C2), [[0.9, 0.45], [0.8, 0.72]])


def test_sync_hand_worked_early_stop():
    # Θ0 = 2·1 = 2; +a=0.9: 2.9·1 = 2.9 keep; +0.8: 3.7·0.9 = 3.33 keep; +0.72: 4.42·0.5 = 2.21 stop.
    sps = table_sps({2: 1.0, 3: 1.0, 4: 0.9, 5: 0.5, 6: 0.5})
    assert sync_prefix_schedule(C2, sps).tolist() == [1, 1]


def test_sync_stops_at_first_non_improvement_even_if_later_is_better():
    # Θ: 2, 2.9, 1.85 (stop here), 3.978, 2.435. Early stop gives [1, 0]; the global search would take 3 items.
    sps = table_sps({2: 1.0, 3: 1.0, 4: 0.5, 5: 0.9, 6: 0.5})
    assert sync_prefix_schedule(C2, sps).tolist() == [1, 0]
    assert sync_prefix_schedule_unsafe_no_early_stop(C2, sps).tolist() == [1, 2]
    assert async_capacity(C2, sps) == 3  # the async capacity search is global on purpose


def test_equal_theta_is_not_an_improvement():
    # Θ0 = 1·1 = 1; adding a = 1.0 at SPS 0.5 gives exactly 1.0: "if Θ > Θ_best" fails, stop.
    sps = table_sps({1: 1.0, 2: 0.5, 3: 1.0})
    assert sync_prefix_schedule(np.array([[1.0, 1.0]]), sps).tolist() == [0]


def test_ties_smaller_slot_then_smaller_request_first():
    c = np.array([[1.0, 1.0], [1.0, 0.5]])  # a = [[1, 1], [1, 0.5]]: three-way tie at 1.0
    sps = table_sps({2: 1.0, 3: 1.0, 4: 1.0, 5: 0.1, 6: 0.1})
    assert sync_prefix_schedule(c, sps).tolist() == [1, 1]  # (0,0) then (1,0), not (0,1)
    assert async_schedule(c, 1).tolist() == [1, 0]
    assert async_schedule(c, 2).tolist() == [1, 1]
    assert async_schedule(c, 3).tolist() == [2, 1]
    assert async_schedule(c, 99).tolist() == [2, 2]


def test_small_top_k_merge_equals_the_sorted_visit_order(monkeypatch):
    # Few requests take top-K by merging their rows (policies.SMALL_MERGE); the slow reference is the full stable
    # sort of the visit order. Confidences from {0, 0.5, 1} make ties in value across slots and requests common.
    import dspark.scheduling.policies as policies

    rng = np.random.default_rng(7)
    cases = [(rng.choice([0.0, 0.5, 1.0], size=(r, g)), k) for r in (2, 3, 4) for g in (1, 3, 7) for _ in range(20)
             for k in (0, 1, 2, 5, r * g, 99)]
    cases += [(rng.uniform(size=(2, 7)), k) for k in range(15) for _ in range(10)]
    fast = [top_k_lengths(c, k) for c, k in cases]
    assert sum(c.shape[0] * min(k, c.size) <= policies.SMALL_MERGE for c, k in cases) > len(cases) // 2
    monkeypatch.setattr(policies, "SMALL_MERGE", 0)
    for (c, k), got in zip(cases, fast):
        assert np.array_equal(got, top_k_lengths(c, k)), (c, k)


def test_capped_algorithm_1_stops_early_or_at_the_cap():
    # Θ: 2, 2.9, 3.33, 2.21: Algorithm 1 admits 2 items; a cap of 1 admits one, a cap of 5 still stops at 2.
    sps = table_sps({2: 1.0, 3: 1.0, 4: 0.9, 5: 0.5, 6: 0.5})
    assert sync_prefix_schedule(C2, sps, capacity=1).tolist() == [1, 0]
    assert sync_prefix_schedule(C2, sps, capacity=5).tolist() == [1, 1]
    assert sync_prefix_schedule(C2, sps, capacity=0).tolist() == [0, 0]
    # where every item improves Θ the capped stop is the top-K
    c = np.random.default_rng(1).uniform(0.2, 1.0, size=(5, 4))
    for k in range(21):
        assert np.array_equal(sync_prefix_schedule(c, lambda b: 1.0, capacity=k), async_schedule(c, k))


def test_capped_algorithm_1_prices_drafting_at_the_depth_drafted():
    # One request; verifying a draft costs 1 ms on a 10 ms step; drafting costs 0.5 ms at depth 1 and 9.5 ms at
    # depth 7. Drafting is sunk, but a longer step makes the same 1 ms of verify relatively cheaper, so a slot-1
    # confidence of 0.08 is not worth verifying after a 1-slot draft and is after a 7-slot one.
    prof = SpeedProfile((1, 2), (0.010, 0.011), (1, 16), (0.0095, 0.0095), shallow_draft_seconds=(0.0005, 0.0005),
                        draft_depth=7)
    c = np.array([[0.08, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5]])
    # depth 1: (1.08) / 11.5 ms = 93.9 < 1 / 10.5 ms = 95.2 -> stop; depth 7: 1.08 / 20.5 = 52.7 > 1 / 19.5 = 51.3
    assert sync_prefix_schedule(c, prof, capacity=1, depth=1).tolist() == [0]
    assert sync_prefix_schedule(c, prof, capacity=1, depth=7).tolist() == [1]


def test_async_early_stop_verifies_at_most_k_and_stops_where_the_next_draft_does_not_pay():
    prof = SpeedProfile((1, 64), (0.010, 0.040), (1, 16), (0.002, 0.004))  # CPU-like: every token costs
    rng = np.random.default_rng(0)
    cs = [rng.beta(4, 1, size=(8, 7)) for _ in range(4)] + [rng.beta(1, 6, size=(8, 7))]  # the text turns hard
    plain, stop = AsyncPolicy(prof), AsyncPolicy(prof, early_stop=True)
    for c in cs:
        plain.prepare(8), stop.prepare(8)
        assert plain.last_capacity == stop.last_capacity  # K is the same: only the admission differs
        k = stop.last_capacity
        got, top_k = stop.select(c), plain.select(c)
        if k is None:
            assert np.array_equal(got, top_k)
        else:
            depth = min(7, k + 1)
            assert np.array_equal(got, sync_prefix_schedule(c, prof, capacity=k, depth=depth))
            assert got.sum() <= top_k.sum() == min(k, c.size)
    assert got.sum() < top_k.sum()  # on the hard step the old K over-promised and the stop cut it
    with pytest.raises(ValueError, match="early_stop"):
        AsyncPolicy(prof, early_stop=2)


# The dev CPU's slow phase at one request: a second token costs 6 ms, a third 24 ms more; drafting 9-16 ms.
JUMP = SpeedProfile((1, 2, 3, 4), (0.0510, 0.0567, 0.0809, 0.0856), (1, 16), (0.0156, 0.0156),
                    shallow_draft_seconds=(0.0088, 0.0088), draft_depth=7)
FLAT = SpeedProfile((1, 8), (0.0510, 0.0520), (1, 16), (0.0156, 0.0156), shallow_draft_seconds=(0.0088, 0.0088),
                    draft_depth=7)


def test_could_grow_asks_whether_the_next_draft_could_pay_at_its_best():
    from dspark.scheduling.policies import could_grow, step_survivals

    c = np.array([[0.5, 0.5, 0.5]])
    pool, shapes = [step_survivals(c)], [c.shape]
    # K = 1 (1.5 / 66.6 ms beats 1 / 51 ms); K = 2 at best adds another 0.5: 2.0 / 92.0 ms < 1.5 / 66.6 ms
    assert not could_grow(pool, shapes, JUMP, 1, 1)
    assert could_grow(pool, shapes, FLAT, 1, 1)
    narrow = np.array([[0.5]])  # a step drafted without the extra slot still bounds slot 2 by slot 1
    assert could_grow([step_survivals(narrow)], [narrow.shape], FLAT, 1, 1)
    with pytest.raises(ValueError, match="capacity"):
        could_grow(pool, shapes, FLAT, 1, 0)


def test_async_lean_depth_drafts_the_extra_slot_only_while_k_could_grow():
    c = np.array([[0.5, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3]])
    for prof, extra in ((JUMP, 0), (FLAT, 1)):
        pol, plain = (AsyncPolicy(prof, lean_depth=True, min_gain=0.0, joint_requests=0),  # K + 1's slot: the old way
                       AsyncPolicy(prof, min_gain=0.0, joint_requests=0))
        for _ in range(4):
            for p in (pol, plain):
                p.prepare(1)
                p.select(c[:, :p.draft_depth(7)])
        k = plain.last_capacity
        assert 1 <= k < 6 and pol.last_capacity == k
        assert (pol.draft_depth(7), plain.draft_depth(7)) == (k + extra, k + 1)
    with pytest.raises(ValueError, match="lean_depth"):
        AsyncPolicy(JUMP, lean_depth=3)


def test_async_spread_depth_drafts_one_past_the_longest_share_of_k():
    """Four requests alike: K is shared one or two slots each, so the depth stops at 3, not K + 1; one request
    holding all the confidence takes K itself, and the cap is K + 1 as without the rule."""
    even = np.tile([[0.9, 0.6, 0.3, 0.2, 0.2, 0.2, 0.2]], (4, 1))
    skewed = np.array([[0.99] * 7] + [[0.05] * 7] * 3)
    for c, capped in ((even, True), (skewed, False)):
        # K priced at depth K + 1 (the rule above joint_requests), which the cap corrects
        pol = AsyncPolicy(FLAT, min_gain=0.0, joint_requests=0)
        plain = AsyncPolicy(FLAT, min_gain=0.0, spread_depth=False, joint_requests=0)
        for _ in range(4):
            for p in (pol, plain):
                p.prepare(4)
                p.select(c[:, :p.draft_depth(7)])
        k = plain.last_capacity
        assert pol.last_capacity == k >= 5
        share = int(async_schedule(c, k).max())
        assert pol.draft_depth(7) == min(7, share + 1, k + 1) and (pol.draft_depth(7) < min(7, k + 1)) == capped
    with pytest.raises(ValueError, match="spread_depth"):
        AsyncPolicy(FLAT, spread_depth=2)


def test_async_schedule_top_k_hand_worked():
    c_now = np.array([[0.5, 0.5], [0.99, 0.99]])  # a = [[0.5, 0.25], [0.99, 0.9801]]
    assert async_schedule(c_now, 3).tolist() == [1, 2]
    assert async_schedule(c_now, 0).tolist() == [0, 0]


def test_async_schedule_of_one_request_equals_the_visit_order():
    """The one-request shortcut (its first K slots) against the general path, zeros and ties included."""
    from dspark.scheduling.policies import _lengths, _visit_order

    rng = np.random.default_rng(3)
    rows = [rng.random((1, 5)), np.zeros((1, 4)), np.ones((1, 3)), np.array([[0.5, 1.0, 0.0, 1.0]])]
    for c in rows:
        for k in range(c.shape[1] + 3):
            order = _visit_order(np.cumprod(c, axis=1))
            assert async_schedule(c, k).tolist() == _lengths(order, min(k, order.size), 1).tolist()


def test_flat_profile_verifies_everything_and_steep_profile_nothing():
    c = np.full((4, 7), 0.8)
    assert sync_prefix_schedule(c, lambda b: 1.0).tolist() == [7] * 4
    assert sync_prefix_schedule(c, lambda b: 1.0 / b).tolist() == [0] * 4  # Θ = τ/B falls with every a < 1


def test_async_capacity_skips_drafting_when_drafting_costs_more_than_it_gains():
    # Compute-bound regime with a drafting cost: plain decoding (no drafter) beats any K.
    prof = SpeedProfile((1, 2), (1.0, 2.0), (1, 100), (0.5, 0.5))
    assert async_capacity(np.full((8, 3), 0.5), prof) == 0
    # Flat verify cost: drafting pays for itself.
    flat = SpeedProfile((1, 1000), (1.0, 1.0), (1, 100), (0.01, 0.01))
    assert async_capacity(np.full((8, 3), 0.5), flat) == 24


def test_fixed_and_threshold():
    assert fixed_k(3, 7, 0).tolist() == [0, 0, 0]
    assert fixed_k(2, 7, 1).tolist() == [1, 1]
    assert fixed_k(2, 3, 9).tolist() == [3, 3]
    c = np.array([[0.9, 0.8, 0.95], [0.5, 0.99, 0.99], [0.9, 0.9, 0.9]])
    # per-slot: leading run of c >= 0.85
    assert static_threshold(c, 0.85).tolist() == [1, 0, 3]
    # cumulative: a = [[.9,.72,.684], [.5,...], [.9,.81,.729]]
    assert static_threshold(c, 0.85, cumulative=True).tolist() == [1, 0, 1]


def test_empty_and_invalid_inputs():
    assert sync_prefix_schedule(np.zeros((0, 7)), lambda b: 1.0).tolist() == []
    assert async_schedule(np.zeros((3, 0)), 5).tolist() == [0, 0, 0]
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        sync_prefix_schedule(np.array([[1.2, 0.5]]), lambda b: 1.0)
    with pytest.raises(ValueError, match="shape"):
        sync_prefix_schedule(np.array([0.5, 0.5]), lambda b: 1.0)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        survival(np.array([[np.nan]]))


def test_torch_input_accepted():
    torch = pytest.importorskip("torch")
    c = torch.tensor(C2, dtype=torch.float32)
    assert sync_prefix_schedule(c, lambda b: 1.0).tolist() == [2, 2]


# ---------------------------------------------------------------- vectorised == reference on random inputs


def random_case(rng):
    R, G = int(rng.integers(1, 30)), int(rng.integers(1, 9))
    kind = rng.integers(3)
    if kind == 0:  # continuous
        c = rng.beta(3, 1, size=(R, G))
    elif kind == 1:  # heavy ties: few distinct values, exact 0s and 1s
        c = rng.choice([0.0, 0.5, 0.9, 1.0], size=(R, G))
    else:  # identical rows: ties across requests everywhere
        c = np.tile(rng.choice([0.7, 1.0], size=(1, G)), (R, 1))
    return c


def random_sps(rng, R):
    kind = rng.integers(3)
    if kind == 0:
        return gpu_like_profile(flat_until=int(rng.integers(1, 64)), draft_seconds=float(rng.uniform(0, 0.01)))
    if kind == 1:  # jagged table (tokens up to R*(G+1) at most 270)
        tokens = tuple(range(1, 300))
        steps = np.cumsum(rng.uniform(0, 0.002, size=len(tokens))) * rng.choice([0, 1], size=len(tokens))
        secs = tuple(float(s) for s in 0.01 + steps)  # rises, with random drops back to 10 ms
        return SpeedProfile(tokens, secs)
    knee = float(rng.uniform(1, 50))
    return lambda b: 1.0 / max(1.0, b / knee) if np.ndim(b) == 0 else 1.0 / np.maximum(1.0, b / knee)


def scalar_view(sps, R):
    """What the reference loop calls: the same function, one B at a time (with R's drafting cost)."""
    return (lambda b: sps.sps(b, n_requests=R)) if isinstance(sps, SpeedProfile) else sps


def test_vectorised_matches_loop_reference():
    rng = np.random.default_rng(123)
    for _ in range(300):
        c = random_case(rng)
        R = c.shape[0]
        sps = random_sps(rng, R)
        ref = scalar_view(sps, R)
        assert np.array_equal(sync_prefix_schedule(c, sps), ref_sync(c, ref))
        assert np.array_equal(sync_prefix_schedule(c, sps, unsafe=True), ref_sync(c, ref, early_stop=False))
        theta0 = R / float(sps.step_s(R)) if isinstance(sps, SpeedProfile) else None
        assert async_capacity(c, sps) == ref_capacity(c, ref, R, theta0)
        k = int(rng.integers(0, c.size + 2))
        assert np.array_equal(async_schedule(c, k), ref_topk(c, k))
        assert np.array_equal(survival(c), ref_survival(c))


# ---------------------------------------------------------------- registry


def test_registry_names_and_unknown_name():
    with pytest.raises(ValueError) as e:
        make_policy("bogus")
    for name in ("none", "mtp1", "fixed", "sync", "async", "threshold"):
        assert name in str(e.value)
    assert make_policy("fixed-3").k == 3
    assert make_policy("mtp1").select(None, n_requests=2, gamma=7).tolist() == [1, 1]
    assert make_policy("none").prepare(5) is False


def test_every_policy_says_whether_the_load_sets_a_requests_length():
    # /health reports it: under a load-dependent policy a seeded sampled request repeats only under the same load
    sps = SpeedProfile((1, 8), (0.01, 0.02))
    for policy in (make_policy("none"), make_policy("mtp1"), make_policy("fixed-3"),
                   make_policy("threshold", threshold=0.5)):
        assert policy.load_dependent is False
    for name in ("sync", "async", "async-online"):
        assert make_policy(name, sps=sps).load_dependent is True


def test_confidence_free_error_names_working_policies():
    with pytest.raises(ConfidenceRequiredError) as e:
        make_policy("sync", sps=lambda b: 1.0, confidence_available=False)
    assert all(n in str(e.value) for n in ("none", "mtp1", "fixed"))
    pol = make_policy("threshold", threshold=0.5)
    with pytest.raises(ConfidenceRequiredError, match="none, mtp1, fixed"):
        pol.select(None, n_requests=3, gamma=7)
    assert set(CONFIDENCE_FREE) == {"none", "mtp1", "fixed"}
    assert CONFIDENCE_FREE == tuple(n for n, (_, needs, _) in POLICIES.items() if not needs)  # the literal is current
    with pytest.raises(TypeError, match="sync"):
        make_policy("sync")  # missing sps


def test_unsafe_flag_warns():
    with pytest.warns(UserWarning, match="NOT lossless"):
        pol = make_policy("sync", sps=lambda b: 1.0, unsafe=True)
    assert pol.name == "sync-unsafe"


def test_async_policy_uses_confidences_from_two_steps_earlier():
    prof = gpu_like_profile()
    pol = AsyncPolicy(prof)
    rng = np.random.default_rng(0)
    cs = [rng.beta(4, 1, size=(64, 7)) for _ in range(5)]
    for t, c in enumerate(cs):
        assert pol.prepare(64) is True
        ell = pol.select(c)
        if t < 2:  # no history: lossless fallback to Algorithm 1 on the current step
            assert pol.last_capacity is None
            assert np.array_equal(ell, sync_prefix_schedule(c, prof))
        else:
            k = async_capacity(cs[t - 2], prof, n_requests=64)
            assert pol.last_capacity == k
            assert np.array_equal(ell, async_schedule(c, k))
    pol.reset()
    assert pol.prepare(64) and pol.last_capacity is None


def test_async_policy_skips_the_drafter_when_capacity_is_zero():
    # Compute-bound profile with a drafting cost: after two steps of history, K = 0 and drafting is skipped.
    prof = SpeedProfile((1, 2), (1.0, 2.0), (1, 100), (0.5, 0.5))
    pol = make_policy("async", sps=prof)
    c = np.full((4, 3), 0.5)
    for _ in range(2):
        assert pol.prepare(4) is True
        pol.select(c)
    assert pol.prepare(4) is False and pol.last_capacity == 0
    assert pol.select(None, n_requests=4).tolist() == [0, 0, 0, 0]  # no confidences needed this step
    assert pol.prepare(4) is False  # history is unchanged by skipped steps


def test_async_policy_probes_after_skipped_steps_and_recovers():
    # Drafting costs as much as a step: K = 0 for weak confidences, K > 0 for near-certain ones.
    prof = SpeedProfile((1, 2, 8), (1.0, 1.0, 1.0), (1, 100), (0.5, 0.5))
    pol = AsyncPolicy(prof, probe_every=3, pool_requests=1)  # one step: the probe alone sets K
    weak, strong = np.full((1, 3), 0.1), np.full((1, 3), 0.99)
    for _ in range(2):  # history: weak confidences
        assert pol.prepare(1) is True
        pol.select(weak)
    for _ in range(3):  # K = 0 from the weak steps: skipped
        assert pol.prepare(1) is False and pol.last_capacity == 0
        pol.select(None, n_requests=1)
    assert pol.prepare(1) is True and pol.last_capacity is None  # the probe: Algorithm 1 on its own confidences
    assert np.array_equal(pol.select(strong), sync_prefix_schedule(strong, prof))
    assert pol.prepare(1) is False  # one step later the probe is not yet old enough: still the weak history
    pol.select(None, n_requests=1)
    assert pol.prepare(1) is True and pol.last_capacity == 3  # two steps later: K from the probe
    assert pol.select(strong).tolist() == [3]


def test_async_probe_drafts_few_requests_and_keeps_only_their_rows():
    prof = SpeedProfile((1, 2, 8), (1.0, 1.0, 1.0), (1, 100), (0.5, 0.5))
    pol = AsyncPolicy(prof, probe_every=1, pool_requests=1, probe_requests=2)
    weak, strong = np.full((6, 3), 0.1), np.full((2, 3), 0.99)
    for _ in range(2):  # no history yet: Algorithm 1 drafts every request
        assert pol.prepare(6) and pol.requests_to_draft(6) == 6
        pol.select(weak)
    assert not pol.prepare(6) and pol.requests_to_draft(6) == 6  # K = 0: skipped (nothing drafted anyway)
    pol.select(None, n_requests=6)
    assert pol.prepare(6) and pol.last_capacity is None and pol.requests_to_draft(6) == 2  # the probe
    shown = np.zeros((6, 3))
    shown[[1, 4]] = strong  # the engine's layout: drafted rows in place, zeros elsewhere
    got = pol.select(shown, drafted=[1, 4])
    assert got[[0, 2, 3, 5]].tolist() == [0, 0, 0, 0] and (got[[1, 4]] > 0).all()
    assert np.array_equal(pol._history[-1][1], strong)  # only the probed rows enter the history
    assert pol.requests_to_draft(1) == 1
    with pytest.raises(ValueError, match="probe_requests"):
        AsyncPolicy(prof, probe_requests=0)


def test_async_policy_backs_off_probing_while_speculation_does_not_pay():
    prof = SpeedProfile((1, 2, 8), (1.0, 1.0, 1.0), (1, 100), (0.5, 0.5))
    pol = AsyncPolicy(prof, probe_every=2, max_probe_every=8, pool_requests=1)
    weak, drafted = np.full((1, 3), 0.1), []
    for step in range(60):
        if pol.prepare(1):
            drafted.append(step)
            pol.select(weak)
        else:
            pol.select(None, n_requests=1)
    # steps 0, 1: no history (Algorithm 1); then probes after 2, 4, 8, 8, ... skipped steps
    assert drafted[:6] == [0, 1, 4, 9, 18, 27]
    assert np.diff(drafted[4:]).tolist() == [9] * (len(drafted) - 5)


def test_async_capacity_pools_steps_as_the_mean_of_their_curves():
    from dspark.scheduling.policies import pooled_gains

    rng = np.random.default_rng(5)
    prof = SpeedProfile((1, 4, 16, 64), (1.0, 1.3, 2.0, 5.0), (1, 64), (0.2, 0.6))
    c = rng.beta(3, 1, size=(4, 5))
    k = async_capacity(c, prof)
    assert async_capacity([c], prof) == k
    assert async_capacity([c, c, c], prof, n_requests=4) == k  # three copies: the same curve
    # One row per step at R = 1: one request verifies a prefix of its own row, so the expected gain of K drafts
    # is the mean of the rows' own cumulative survivals at K, not the top 8K of all 40 pooled survivals / 8
    # (that curve mixes the best rows' later slots into "slot 1" and over-promises)
    rows = [rng.beta(3, 1, size=(1, 5)) for _ in range(8)]
    flat = lambda b: 1.0 / (1.0 + 0.3 * b)  # noqa: E731
    gains = pooled_gains(rows, n_requests=1)
    per_row = np.mean([np.concatenate(([0.0], np.cumsum(np.cumprod(r)))) for r in rows], axis=0)
    np.testing.assert_allclose(gains, per_row)
    a = -np.sort(-np.cumprod(np.concatenate(rows), axis=1).ravel())
    whole_pool = np.cumsum(np.concatenate(([0.0], a)))[8 * np.arange(6)] / 8
    assert np.all(gains <= whole_pool + 1e-12) and gains[1] < whole_pool[1]
    theta = [(1 + gains[k]) * flat(1 + k) for k in range(6)]
    assert async_capacity(rows, flat, n_requests=1) == int(np.argmax(theta))
    # Two requests now, steps of 4 and 1 rows: each step's curve priced for 2 requests, weighted by its rows
    two = [rng.beta(3, 1, size=(4, 5)), rng.beta(3, 1, size=(1, 5))]
    curves = []
    for step in two:
        cum = np.concatenate(([0.0], np.cumsum(-np.sort(-np.cumprod(step, axis=1).ravel()))))
        f = step.shape[0] / 2
        curves.append(np.interp(f * np.arange(11), np.arange(cum.size), cum) / f)
    np.testing.assert_allclose(pooled_gains(two, n_requests=2), (4 * curves[0] + curves[1]) / 5)
    with pytest.raises(ValueError, match="at least one"):
        async_capacity([], prof)


def test_async_policy_pools_low_load_history_so_k_stops_flipping():
    # R = 1, easy and hard rounds alternating: from one step, K flips between 0 (skip the drafter) and 7; from a
    # pool of 8 steps it stays at the K of the average round.
    prof = SpeedProfile((1, 4, 8), (1.0, 1.25, 1.6), (1, 8), (0.2, 0.2))
    easy, hard = np.full((1, 7), 0.95), np.full((1, 7), 0.05)
    ks = {}
    for pool in (1, 8):
        pol = AsyncPolicy(prof, pool_requests=pool, pool_steps=8, probe_every=1)
        got = []
        for t in range(40):
            c = easy if t % 2 else hard
            pol.prepare(1)
            got.append(pol.last_capacity)
            pol.select(c) if pol.last_capacity != 0 else pol.select(None, n_requests=1)
        ks[pool] = got[20:]
    assert 0 in ks[1] and max(ks[1]) > 0  # one step: flips between skipping and drafting
    assert len(set(ks[8]) - {None}) == 1 and ks[8][-1] > 0  # pooled: one steady K
    with pytest.raises(ValueError, match="pool_requests"):
        AsyncPolicy(prof, pool_requests=0)


def test_async_policy_rejects_bad_probe_interval():
    with pytest.raises(ValueError, match="probe_every"):
        AsyncPolicy(lambda b: 1.0, probe_every=0)
    with pytest.raises(ValueError, match="probe_every"):
        AsyncPolicy(lambda b: 1.0, probe_every=16, max_probe_every=8)


def test_async_policy_reuses_k_while_its_pool_is_unchanged(monkeypatch):
    import dspark.scheduling.async_policy as ap

    calls = []
    for name in ("capacity_from_survivals", "capacity_and_depth"):  # K alone, or with the depth (R <= 2)
        real = getattr(ap, name)
        monkeypatch.setattr(ap, name, lambda *a, _real=real, **k: calls.append(1) or _real(*a, **k))
    prof = SpeedProfile((1, 4, 8), (1.0, 1.25, 1.6), (1, 8), (0.3, 0.3))
    rng = np.random.default_rng(2)
    memo, fresh = (AsyncPolicy(prof, probe_every=4, low_stay_gain=None) for _ in range(2))  # runs end at a loss
    ks = {id(memo): [], id(fresh): []}
    cs = [rng.beta(1, 3, size=(1, 7)) for _ in range(300)]
    for pol in (memo, fresh):
        for c in cs:
            if pol is fresh:
                pol._memo = (None, 0, None)  # forget: every step priced from scratch
            ks[id(pol)].append(pol.prepare(1) and pol.last_capacity)
            pol.select(c if pol.last_capacity != 0 else None, n_requests=1)
        if pol is memo:
            n_memo, calls[:] = len(calls), []
    assert ks[id(memo)] == ks[id(fresh)]  # the same decisions
    # a drafted step changes the pool twice (when it is lag steps old and when it ages out), a skipped one never
    drafted = sum(k != 0 for k in ks[id(memo)])
    assert n_memo <= 2 * drafted < len(calls) / 2


def test_async_prices_and_drafts_only_as_deep_as_k_can_use():
    from dspark.scheduling.policies import draft_depth_for, pooled_gains

    assert [draft_depth_for(k, 7) for k in (0, 1, 2, 6, 20)] == [1, 2, 3, 7, 7]
    # One request: full-depth drafting (8 ms) never pays against a 10 ms step; priced at the depth K needs
    # (0.5 ms + 1.875 ms per extra slot), K = 1 does (2 slots drafted).
    c = np.array([[0.5, 0.3, 0.3, 0.3, 0.3]])
    deep = SpeedProfile((1, 64), (0.010, 0.011), (1, 16), (0.008, 0.008))
    shallow = SpeedProfile((1, 64), (0.010, 0.011), (1, 16), (0.008, 0.008), shallow_draft_seconds=(0.0005, 0.0005),
                           draft_depth=5)
    assert async_capacity(c, deep) == 0
    assert async_capacity(c, shallow) == 1
    pol = AsyncPolicy(shallow, pool_requests=1, joint_requests=0)  # K priced at depth K + 1
    assert pol.prepare(1) and pol.draft_depth(5) == 5  # no history yet: Algorithm 1 on the full block
    pol.select(c)
    pol.prepare(1), pol.select(c)
    assert pol.prepare(1) and pol.last_capacity == 1 and pol.draft_depth(5) == 2
    assert pol.select(c[:, :2]).tolist() == [1]  # the shallow block's confidences go into the history
    # A shallow step in the pool says nothing of deeper slots: flat there, and the deeper step's width counts
    gains = pooled_gains([c[:, :2], c], n_requests=1)
    np.testing.assert_allclose(gains, [0, 0.5, 0.65, 0.6725, 0.67925, 0.681275])


def test_async_does_not_draft_for_a_gain_inside_the_margin():
    c = np.array([[0.5, 0.5, 0.5]])
    sps = lambda b: 1.0 / (0.010 + 0.0048 * (np.asarray(b) - 1))  # noqa: E731  K = 1: +1.35 % over K = 0
    assert async_capacity(c, sps) == 1
    assert async_capacity(c, sps, min_gain=0.03) == 0
    assert async_capacity(c, sps, min_gain=0.01) == 1
    assert AsyncPolicy(sps).min_gain == 0.03
    with pytest.raises(ValueError, match="min_gain"):
        AsyncPolicy(sps, min_gain=1.5)


def test_policy_options_follow_the_name():
    from dspark.scheduling.profile import SpeedProfile
    from dspark.scheduling.registry import make_policy

    sps = SpeedProfile((1, 8), (0.01, 0.02))
    pol = make_policy("async:min_gain=0.01:probe_every=16", sps=sps)
    assert pol.min_gain == 0.01 and pol.probe_every == 16 and isinstance(pol.probe_every, int)
    assert make_policy("threshold:threshold=0.7").threshold == 0.7
    for bad, match in [("async:min_gain", "name=number"), ("async:min_gain=x", "name=number"),
                       ("async:=1", "name=number"), ("async:bogus=1", "bogus")]:
        with pytest.raises((ValueError, TypeError), match=match):
            make_policy(bad, sps=sps)


def test_policy_specs_are_checked_before_anything_loads():
    from dspark.engine.llm import LLM
    from dspark.scheduling.registry import check_spec

    for good in ("auto", "async", "async:min_gain=0.1:hold_backoff=0", "async-online:probe_every=4", "fixed-3",
                 "mtp1", "threshold:threshold=0.3", "sync:unsafe=0"):
        check_spec(good)
    for bad, match in [("fixed-three", "unknown policy 'fixed-three'"), ("async:min_gian=1", "min_gian"),
                       ("none:k=2", "no options"), ("auto:min_gain=1", "unknown policy 'auto'"),
                       ("async:min_gain", "name=number")]:
        with pytest.raises(ValueError, match=match):
            check_spec(bad)
    with pytest.raises(ValueError, match="min_gian"):  # refused before the (missing) model is looked for
        LLM(model="/nonexistent/model", policy="async:min_gian=1")


def test_build_policy_prices_a_policy_spec_by_its_base_name():
    """`sync:...` / `async:...` get the speed profile and `threshold:...` the default threshold, as the bare names do."""
    from types import SimpleNamespace
    from unittest import mock

    from dspark.engine import llm

    drafter = SimpleNamespace(has_confidence=True, profile_id="d")
    sps = SpeedProfile((1, 8), (0.01, 0.02))
    with mock.patch("dspark.engine.profiling.load_or_profile", return_value=sps), \
            mock.patch("dspark.engine.profiling.profile_key", return_value=None):
        pol = llm.build_policy("sync:unsafe=0", drafter, "m", "float32", None, 7)
        live = llm.build_policy("async:live=1", drafter, "m", "float32", None, 7)
    assert pol.sps is sps and live.live.base is sps and live.sps is sps
    assert llm.build_policy("threshold:cumulative=1", drafter, "m", "float32", None, 7).threshold == 0.5


def _two_level_sps(b):
    """One token per step at 1 step/s, any speculation at 1/1.4: a one-slot draft pays iff c > 0.4 and beats
    plain decoding by 10 % iff c > 0.54."""
    return np.where(np.asarray(b) >= 2, 1 / 1.4, 1.0)


def _run(pol, confidences):
    """Step `pol` once per [1, 1] confidence (used only where the policy drafts) -> K of each step."""
    ks = []
    for c in confidences:
        drafts = pol.prepare(1)
        ks.append(pol.last_capacity)
        pol.select(np.array([[c]]) if drafts else None, n_requests=1)
    return ks


def test_async_policy_keeps_drafting_while_it_pays_and_enters_only_past_the_margin():
    strong, mid = 0.9, 0.5  # mid: pays (1.5 / 1.4 = 1.07) but under the 10 % margin
    hyst = AsyncPolicy(_two_level_sps, min_gain=0.1, pool_requests=1)
    plain = AsyncPolicy(_two_level_sps, min_gain=0.1, pool_requests=1, stay_gain=0.1, low_stay_gain=None)
    # steps 0-1 have no old history (Algorithm 1); K at steps 2-3 comes from the strong steps 0-1
    assert _run(hyst, [strong, strong, mid, mid, mid, mid]) == [None, None, 1, 1, 1, 1]
    assert _run(plain, [strong, strong, mid, mid, mid, mid]) == [None, None, 1, 1, 0, 0]
    fresh = AsyncPolicy(_two_level_sps, min_gain=0.1, pool_requests=1)  # not drafting: mid does not start a run
    assert _run(fresh, [mid, mid, mid, mid]) == [None, None, 0, 0]


def test_async_policy_at_low_load_ends_a_run_only_on_a_clear_loss():
    strong, dip = 0.9, 0.37  # dip: a one-slot draft priced at 1.37 / 1.4 = 0.979 of plain decoding
    low = AsyncPolicy(_two_level_sps, min_gain=0.1, pool_requests=1)  # R = 1 <= joint_requests: low_stay_gain -3 %
    assert low.low_stay_gain == -0.03 and low.stay_gain == 0.0
    assert _run(low, [strong, strong, dip, dip, dip, dip]) == [None, None, 1, 1, 1, 1]
    off = AsyncPolicy(_two_level_sps, min_gain=0.1, pool_requests=1, low_stay_gain=None)  # stay_gain at every R
    assert _run(off, [strong, strong, dip, dip, dip, dip]) == [None, None, 1, 1, 0, 0]
    assert _run(AsyncPolicy(_two_level_sps, min_gain=0.1, pool_requests=1), [strong, strong, 0.3, 0.3, 0.3])[4] == 0  # priced 0.93

    def ks_at(n_requests, **options):  # K = R drafts of one slot each, priced as one request's
        sps = lambda b: np.where(np.asarray(b) > n_requests, 1 / 1.4, 1.0)  # noqa: E731
        pol, ks = AsyncPolicy(sps, min_gain=0.1, pool_requests=1, **options), []
        for c in [strong, strong, dip, dip, dip, dip]:
            drafts = pol.prepare(n_requests)
            ks.append(pol.last_capacity)
            pol.select(np.full((n_requests, 1), c) if drafts else None, n_requests=n_requests)
        return ks

    assert ks_at(2) == [None, None, 2, 2, 2, 2]
    assert ks_at(4) == [None, None, 4, 4, 4, 4]  # joint_requests = 4: still low load
    assert ks_at(5) == [None, None, 5, 5, 0, 0]  # above it the run ends where drafting is priced under plain
    assert ks_at(5, joint_requests=5) == [None, None, 5, 5, 5, 5]
    assert ks_at(3, joint_requests=2) == [None, None, 3, 3, 0, 0]  # the default before session 46
    for bad in ({"low_stay_gain": 0.2}, {"low_stay_gain": -1.0}):
        with pytest.raises(ValueError, match="low_stay_gain"):
            AsyncPolicy(_two_level_sps, min_gain=0.1, **bad)


def test_async_policy_looks_again_soon_after_a_drafting_run_ends():
    weak = 0.1
    pol = AsyncPolicy(_two_level_sps, min_gain=0.1, pool_requests=1, probe_every=8, reprobe_every=2)
    ks = _run(pol, [0.9, 0.9] + [weak] * 14)
    # K = 1 from the strong steps, the weak steps 2-3 end the run at step 4; probes after 2 skipped steps, then 4, 8
    assert ks == [None, None, 1, 1, 0, 0, None, 0, 0, 0, 0, None, 0, 0, 0, 0]
    again = AsyncPolicy(_two_level_sps, min_gain=0.1, pool_requests=1, probe_every=8, reprobe_every=8)
    assert _run(again, [0.9, 0.9] + [weak] * 14).index(None, 2) == 12  # the old rule: a full interval first
    # with more requests than a probe drafts, a probe costs drafting: the first one waits the full interval
    sps3 = lambda b: np.where(np.asarray(b) > 3, 1 / 1.4, 1.0)  # noqa: E731
    pol3, ks3 = AsyncPolicy(sps3, min_gain=0.1, pool_requests=1, probe_every=8, reprobe_every=2), []
    for c in [0.9, 0.9] + [weak] * 12:
        drafts = pol3.prepare(3)
        ks3.append(pol3.last_capacity)
        pol3.select(np.full((3, 1), c) if drafts else None, n_requests=3)
    assert ks3[2:5] == [3, 3, 0] and ks3.index(None, 2) == 12
    for bad in ({"reprobe_every": 0}, {"reprobe_every": 128}, {"stay_gain": 0.2}, {"max_age": 1}):
        with pytest.raises(ValueError):
            AsyncPolicy(_two_level_sps, min_gain=0.1, **bad)


def test_async_policy_does_not_pool_confidences_older_than_max_age():
    weak, strong = 0.1, 0.9

    def ks(max_age):
        pol = AsyncPolicy(_two_level_sps, min_gain=0.1, pool_requests=4, probe_every=3, max_age=max_age)
        # steps 0-1 Algorithm 1 on weak; 2-4 skipped; 5 probes (strong); 6 still prices steps 0-1
        return _run(pol, [weak] * 5 + [strong] * 3)  # a skipped step ignores its value

    # step 7: pooled with the weak steps 0-1 the probe's row is outvoted (mean 0.37); alone (max_age 4) it is not
    assert ks(None) == [None, None, 0, 0, 0, None, 0, 0]
    assert ks(4) == [None, None, 0, 0, 0, None, 0, 1]


def test_async_policy_keeps_probing_near_the_threshold_when_a_probe_drafts_everyone():
    near, far = 0.35, 0.1  # drafting priced at 0.96 and 0.79 of plain decoding

    def drafted(c, n_requests):
        # plain decoding of R requests at 1 step/s, any drafts at 1/1.4: K = R drafts are priced at 0.96 or 0.79
        sps = lambda b: np.where(np.asarray(b) > n_requests, 1 / 1.4, 1.0)  # noqa: E731
        pol = AsyncPolicy(sps, min_gain=0.1, pool_requests=1, probe_every=2, max_probe_every=8)
        steps = []
        for step in range(30):
            if pol.prepare(n_requests):
                steps.append(step)
                pol.select(np.full((n_requests, 1), c))
            else:
                pol.select(None, n_requests=n_requests)
        return steps[:6]

    assert drafted(near, 1) == [0, 1, 4, 7, 10, 13]  # a probe is a drafting step: look every 2 skipped steps
    assert drafted(far, 1) == [0, 1, 4, 9, 18, 27]  # clearly not paying: back off 2, 4, 8
    assert drafted(near, 3) == [0, 1, 4, 9, 18, 27]  # a probe drafts 2 of 3 requests: it costs, so back off


def test_async_policy_prices_k_from_kept_survivals_exactly_as_from_confidences():
    """The policy keeps each drafted step's sorted survivals and prices K from them; the reference recomputes them
    from the pooled confidences. Same K and the same predicted gain, bit for bit, over pools at R = 1 (up to 8
    steps), of mixed depths (K + 1 slots drafted), and of steps with other R."""
    from dspark.scheduling.policies import best_capacity, capacity_from_survivals

    prof = SpeedProfile((1, 4, 8, 16), (1.0, 1.25, 1.6, 2.4), (1, 4, 8), (0.3, 0.5, 0.9),
                        shallow_draft_seconds=(0.1, 0.2, 0.35), draft_depth=7)
    rng = np.random.default_rng(5)
    policy = AsyncPolicy(prof, probe_every=2, min_gain=0.0)
    compared, shapes_seen = 0, set()
    for _ in range(400):
        n_req = int(rng.choice([1, 1, 1, 2, 3]))
        _, pool = policy._old_confidences()
        if pool:
            shapes = [c.shape for c, _, _ in pool]
            want = best_capacity([c for c, _, _ in pool], prof, n_requests=n_req)
            assert capacity_from_survivals([a for _, a, _ in pool], shapes, prof, n_req) == want
            compared, shapes_seen = compared + 1, shapes_seen | set(shapes)
        drafts = policy.prepare(n_req)
        c = rng.beta(2, 2, size=(n_req, policy.draft_depth(7))) if drafts else None
        policy.select(c, n_requests=n_req, gamma=7)
    assert compared > 200 and len({g for _, g in shapes_seen}) > 1 and len({r for r, _ in shapes_seen}) > 1


# ---------------------------------------------------------------- K and the drafted depth priced together


def ref_capacity_and_depth(steps, prof, base, margin=0.0):
    """Every (K, depth) by brute force: depth 1 priced from every pooled step, depth d from depth d - 1's gains
    times what the steps that drafted >= d slots gain truncated to d over the same steps truncated to d - 1."""
    from dspark.scheduling.policies import pooled_gains

    def flat(g, size):  # gains past the last slot stay flat
        return np.concatenate([g, np.full(size - g.size, g[-1])])

    plain = base / prof.step_s(base, n_requests=base)
    per_k, gains = {}, None  # K -> its best (Θ, depth)
    for d in range(1, max(c.shape[1] for c in steps) + 1):
        deep = [c for c in steps if c.shape[1] >= d]
        here = pooled_gains([c[:, :d] for c in deep], n_requests=base)
        if gains is not None:
            lower = flat(pooled_gains([c[:, :d - 1] for c in deep], n_requests=base), here.size)
            here = flat(gains, here.size) * np.divide(here, lower, out=np.ones_like(here), where=lower > 0)
        gains = here
        for k in range(d, base * d + 1):  # K < d: slots no request could verify
            theta = (base + gains[k]) * prof.sps(base + k, n_requests=base, depth=d)
            if theta > per_k.get(k, (-np.inf,))[0]:  # ties: the shallower depth
                per_k[k] = (theta, d)
    top = max(theta for theta, _ in per_k.values())
    k = min(k for k, (theta, _) in per_k.items() if theta >= top * (1 - margin))
    return k, per_k[k][1], per_k[k][0] / plain


def test_capacity_and_depth_matches_brute_force_over_mixed_pools():
    """Pools of steps of other R and of other drafted depths (a probe's full block, an exploring slot): the same
    (K, depth) as trying every pair, and the same predicted gain."""
    from dspark.scheduling.depth_pricing import capacity_and_depth, depth_survivals

    prof = SpeedProfile((1, 4, 8, 16), (1.0, 1.25, 1.6, 2.4), (1, 4, 8), (0.3, 0.5, 0.9),
                        shallow_draft_seconds=(0.1, 0.2, 0.35), draft_depth=7)
    rng = np.random.default_rng(3)
    depths_chosen, smaller = set(), 0
    for _ in range(150):
        base = int(rng.choice([1, 2, 3, 4]))
        steps = [rng.beta(3, 1.5, size=(int(rng.choice([1, 2, base])), int(rng.integers(1, 8))))
                 for _ in range(int(rng.integers(1, 5)))]
        by_depth, rows = [depth_survivals(c) for c in steps], [c.shape[0] for c in steps]
        k, d, ratio = capacity_and_depth(by_depth, rows, prof, base)
        want = ref_capacity_and_depth(steps, prof, base)
        assert (k, d) == want[:2] and ratio == pytest.approx(want[2], rel=1e-12)
        assert 1 <= k <= base * d
        depths_chosen.add(d)
        k_m, d_m, ratio_m = capacity_and_depth(by_depth, rows, prof, base, margin=0.03)
        want = ref_capacity_and_depth(steps, prof, base, margin=0.03)
        assert (k_m, d_m) == want[:2] and ratio_m == pytest.approx(want[2], rel=1e-12)
        assert k_m <= k and ratio >= ratio_m >= ratio * 0.97 - 1e-12  # a smaller K, priced within the margin
        smaller += k_m < k
    assert len(depths_chosen) >= 3 and smaller >= 10


def test_a_thin_deep_sample_sets_the_next_slots_odds_not_the_level():
    """At one request seven pooled steps drafted one slot (confidence 0.3) and a probe drafted seven (0.95 then
    0.9 each). The level, slot 1, comes from all eight steps; the probe only says how likely each further slot is
    once the one before it is accepted, so K's gain is 0.38125·(1 + 0.9 + ... + 0.9^(K-1)). Priced from the probe
    alone, depth 7 looked worth drafting for K = 1 (a 0.95 first slot), slots nothing could verify. And over
    random pools of one batch size no depth deeper than K is ever chosen."""
    from dspark.scheduling.depth_pricing import capacity_and_depth, depth_survivals

    prof = SpeedProfile((1, 4, 8, 16), (1.0, 1.05, 1.1, 1.3), (1, 4, 8), (0.05, 0.06, 0.1),
                        shallow_draft_seconds=(0.02, 0.03, 0.05), draft_depth=7)
    steps = [np.array([[0.3]])] * 7 + [np.array([[0.95] + [0.9] * 6])]
    k, d, ratio = capacity_and_depth([depth_survivals(c) for c in steps], [1] * 8, prof, 1)
    level = (7 * 0.3 + 0.95) / 8
    gain = level * sum(0.9 ** j for j in range(k))
    assert d == k and ratio == pytest.approx((1 + gain) * prof.sps(1 + k, n_requests=1, depth=k)
                                             * prof.step_s(1, n_requests=1), rel=1e-9)
    rng = np.random.default_rng(0)
    for _ in range(300):
        base = int(rng.integers(1, 5))
        pool = [rng.beta(3, 1.5, size=(base, int(rng.integers(1, 8)))) for _ in range(int(rng.integers(1, 9)))]
        k, d, _ = capacity_and_depth([depth_survivals(c) for c in pool], [base] * len(pool), prof, base)
        assert 1 <= d <= k <= base * d


def test_small_pools_priced_in_python_give_the_same_floats_as_numpy(monkeypatch):
    """Pools of one or two requests (depth_pricing.SMALL) are priced in plain Python; the numpy path is the
    reference, and both must give the same (K, depth) and the very same ratio, ties included."""
    import dspark.scheduling.depth_pricing as dp

    prof = SpeedProfile((1, 4, 8, 16), (1.0, 1.25, 1.6, 2.4), (1, 4, 8), (0.3, 0.5, 0.9),
                        shallow_draft_seconds=(0.1, 0.2, 0.35), draft_depth=7)
    rng = np.random.default_rng(11)
    cases = []
    for _ in range(200):
        base = int(rng.choice([1, 2]))
        draw = (lambda size: rng.choice([0.0, 0.5, 1.0], size=size)) if rng.random() < 0.3 else \
            (lambda size: rng.beta(3, 1.5, size=size))  # ties among values, or none
        cases.append(([draw((base, int(rng.integers(1, 8)))) for _ in range(int(rng.integers(1, 5)))], base))
    fast = [dp.capacity_and_depth([dp.depth_survivals(c) for c in steps], [base] * len(steps), prof, base,
                                  margin=margin) for steps, base in cases for margin in (0.0, 0.03)]
    monkeypatch.setattr(dp, "SMALL", 0)
    slow = [dp.capacity_and_depth([dp.depth_survivals(c) for c in steps], [base] * len(steps), prof, base,
                                  margin=margin) for steps, base in cases for margin in (0.0, 0.03)]
    assert fast == slow


def test_joint_depth_drafts_two_slots_for_two_requests_where_k_plus_one_refuses():
    """Two requests whose first two slots are near-certain, on a machine where verifying up to four drafts is free
    but every drafted slot costs: fixed-2's shape (K = 4 at depth 2) pays, and the joint price finds it. Priced at
    depth K + 1, K = 4 drafts five slots a request and loses to plain decoding, so that policy never drafts."""
    prof = SpeedProfile((2, 6, 8), (0.010, 0.010, 0.020), (1, 2, 16), (0.0185, 0.0185, 0.0185),
                        shallow_draft_seconds=(0.0015, 0.0015, 0.0015), draft_depth=7)
    c = np.tile([[0.5, 0.9, 0.2, 0.2, 0.2, 0.2, 0.2]], (2, 1))
    joint, plain = AsyncPolicy(prof, explore_every=1000), AsyncPolicy(prof, joint_requests=0)
    for pol in (joint, plain):
        for _ in range(6):
            drafts = pol.prepare(2)
            pol.select(c[:, :pol.draft_depth(7)] if drafts else None, n_requests=2)
    assert (joint.last_capacity, joint.draft_depth(7)) == (4, 2) and joint.last_ratio > 1.3
    assert plain.last_capacity == 0 and plain.last_ratio < 1.0


def test_joint_depth_explores_one_slot_deeper_every_explore_every_drafting_steps():
    """The priced depth is drafted, and one slot more on the first drafting step and every explore_every-th after
    it, so that the pool learns whether a deeper draft would pay; before any pool the whole block is drafted."""
    c = np.array([[0.95, 0.9, 0.1, 0.1, 0.1, 0.1, 0.1]])
    pol = AsyncPolicy(JUMP, explore_every=3, min_gain=0.0)
    steps = []
    for _ in range(14):
        drafts = pol.prepare(1)
        steps.append((pol.draft_depth(7), pol._depth, pol._explore, pol.last_capacity))
        pol.select(c[:, :steps[-1][0]] if drafts else None, n_requests=1)
    assert [s[0] for s in steps[:2]] == [7, 7] and steps[0][3] is None  # no pool old enough: Algorithm 1
    drafting = steps[2:]
    assert all(k and depth == priced + explore for depth, priced, explore, k in drafting)
    assert [s[2] for s in drafting] == [i % 3 == 0 for i in range(len(drafting))]
    assert {s[1] for s in drafting[-6:]} == {2} and {s[3] for s in drafting[-6:]} == {2}
    for bad in (dict(joint_requests=-1), dict(explore_every=0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            AsyncPolicy(FLAT, **bad)


def test_joint_pricing_pools_steps_of_a_larger_batch_when_the_load_falls():
    """Steps drafted at R = 6 keep no per-depth survivals (joint pricing never sees R > joint_requests = 4 as the
    current load); when the batch falls to 2 they are still in the pool, and are priced jointly as if kept."""
    from dspark.scheduling.depth_pricing import capacity_and_depth, depth_survivals

    rng = np.random.default_rng(4)
    pol = AsyncPolicy(FLAT, min_gain=0.0, max_age=None)
    for _ in range(4):
        drafts = pol.prepare(6)
        pol.select(rng.beta(3, 1.5, size=(6, pol.draft_depth(7))) if drafts else None, n_requests=6)
    assert all(d is None for *_, d in pol._history)
    _, pool = pol._old_confidences()
    want = capacity_and_depth([depth_survivals(c) for c, _, _ in pool], [c.shape[0] for c, _, _ in pool], FLAT, 2,
                              margin=pol.k_margin)
    assert pol.prepare(2) and (pol.last_capacity, pol._depth, pol.last_ratio) == want


def test_depth_survivals_in_plain_python_equal_numpys_bit_for_bit():
    """Steps of up to 32 values are handled in plain Python (cold numpy calls cost the policy ~100 µs a step);
    the running products and the sorted rows must be numpy's exactly, or K could differ between the paths."""
    from dspark.scheduling.depth_pricing import depth_survivals

    def numpy_path(c):
        a = np.cumprod(c, axis=1)
        out = np.zeros((a.shape[1], a.size))
        for depth in range(1, a.shape[1] + 1):
            out[depth - 1, :a.shape[0] * depth] = -np.sort(-a[:, :depth].ravel())
        return out

    rng = np.random.default_rng(0)
    for _ in range(3000):
        c = rng.uniform(0, 1, (int(rng.integers(1, 5)), int(rng.integers(1, 8))))
        c[rng.random(c.shape) < 0.1] = 0.0  # exact zeros and ties among the products
        assert np.array_equal(depth_survivals(c), numpy_path(c))
    for bad in ([[0.5, float("nan")]], [[1.2]], [[-0.1, 0.3]], np.full((1, 40), np.nan)):  # both validation paths
        with pytest.raises(ValueError, match=r"\[0, 1\]"):
            as_confidences(bad)


def test_pricing_and_top_k_from_kept_lists_equal_the_arrays_path():
    """The async policy keeps a small step's survival lists and hands them to the pricing and to its own top-K;
    both must decide exactly as they do from the arrays (ties included)."""
    from dspark.scheduling.depth_pricing import capacity_and_depth, depth_lists, depth_survivals, running_products
    from dspark.scheduling.policies import top_k_lengths

    rng, prof = np.random.default_rng(1), SpeedProfile((1, 4, 8, 16), (1.0, 1.2, 1.5, 2.2), (1, 8), (0.2, 0.3))
    for _ in range(400):
        r = int(rng.integers(1, 3))
        steps = [rng.uniform(0, 1, (r, int(rng.integers(1, 8)))).round(1) for _ in range(int(rng.integers(1, 6)))]
        runs = [running_products(c.tolist()) for c in steps]
        by_depth = [depth_survivals(c) for c in steps]
        assert capacity_and_depth(by_depth, [r] * len(steps), prof, r, [depth_lists(x) for x in runs]) == \
            capacity_and_depth(by_depth, [r] * len(steps), prof, r)
        k = int(rng.integers(0, 2 * steps[0].size + 1))
        assert np.array_equal(top_k_lengths(steps[0], k, runs[0]), top_k_lengths(steps[0], k))
