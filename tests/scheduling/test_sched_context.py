"""Context-aware step prices (scheduling/profile.py): a verified token attends to its request's whole context, so a
step costs more the longer the running requests' contexts; the profile measures that, the schedulers price each
step at the running requests' mean context, and the engine and the simulator tell them what it is."""
import numpy as np
import pytest
from helpers import FakeClock

from dspark.scheduling import (AsyncPolicy, ClosedLoop, FixedPolicy, ProfileKey, SpeedProfile, current_machine,
                               load_cached_profile, measure_profile, save_profile, simulate, synthetic_traces)
from dspark.scheduling.policy_objects import SyncPolicy
from dspark.scheduling.profile_measure import fit_context_cost

KEY = ProfileKey("m", "d", current_machine(), "float32")
# R requests verifying k tokens each at 256 tokens of context: 10 ms + 1 ms per request + 0.5 ms per draft. Each
# token of context beyond 256 costs 1 µs per request and 4 µs per verified token.
GRID = tuple(tuple(0.010 + 0.001 * r + 0.0005 * r * (k - 1) for k in (1, 2, 8)) for r in (1, 4))
CTX = SpeedProfile((1, 32), (0.011, 0.040), grid_requests=(1, 4), grid_tokens=(1, 2, 8), grid_seconds=GRID,
                   draft_requests=(1, 4), draft_seconds=(0.001, 0.002), key=KEY, grid_context=256,
                   context_request_s=1e-6, context_token_s=4e-6)


def test_a_step_is_priced_at_the_mean_context_linearly_in_requests_and_verified_tokens():
    at = CTX.at_context(1256)
    assert at.step_s(8, n_requests=1) == pytest.approx(CTX.step_s(8, n_requests=1) + 1000 * (1e-6 + 8 * 4e-6))
    assert at.step_s(4, n_requests=4) == pytest.approx(CTX.step_s(4, n_requests=4) + 1000 * (4e-6 + 4 * 4e-6))
    np.testing.assert_allclose(at.step_s(np.array([1, 8]), 1), [CTX.step_s(1, 1) + 5e-3, CTX.step_s(8, 1) + 33e-3])
    assert CTX.at_context(256).step_s(8, n_requests=1) == pytest.approx(CTX.step_s(8, n_requests=1))
    assert CTX.at_context(0) is CTX and CTX.step_s(8, 1) == CTX.at_context(256).step_s(8, 1)
    shorter = CTX.at_context(128).step_s(8, n_requests=1)
    assert shorter == pytest.approx(CTX.step_s(8, 1) - 128 * 33e-6)
    assert CTX.at_context(1).step_s(32, 4) >= 0.5 * CTX.step_s(32, 4)  # never under half the table's price
    # a prompt chunk alone is its own table's business; decoding beside it is priced at the context
    assert at.step_s(0, n_requests=0, prefill=(64,)) == CTX.step_s(0, n_requests=0, prefill=(64,))
    assert at.sps(8, 1) == pytest.approx(1 / (at.step_s(8, 1) + CTX.draft_s(1)))


def test_a_profile_hashes_once_and_each_context_view_by_its_own_fields():
    import dataclasses

    fresh = dataclasses.replace(CTX)  # equal fields, hash not yet computed
    assert fresh == CTX and hash(fresh) == hash(CTX)
    assert hash(CTX) == hash(tuple(getattr(CTX, f.name) for f in dataclasses.fields(CTX) if f.compare))
    at = CTX.at_context(1256)  # a copy of a profile whose hash was cached: it must not keep that hash
    assert at != CTX and hash(at) == hash(dataclasses.replace(CTX, context=1256.0)) != hash(CTX)
    assert {CTX: 1, at: 2}[CTX.at_context(1256)] == 2  # the price caches find a view by its context


def test_a_profile_without_context_prices_ignores_the_context():
    plain = SpeedProfile((1, 32), (0.011, 0.040), grid_requests=(1, 4), grid_tokens=(1, 2, 8), grid_seconds=GRID)
    assert not plain.prices_context and plain.at_context(4000) is plain


def test_context_prices_survive_the_cache_and_bad_ones_are_refused(tmp_path):
    back = load_cached_profile(save_profile(CTX, tmp_path / "p.json"), KEY)
    assert back == CTX and back.prices_context and back.context == 0
    assert load_cached_profile(save_profile(CTX.at_context(900), tmp_path / "q.json"), KEY).context == 0
    with pytest.raises(ValueError, match="context"):
        SpeedProfile((1,), (0.1,), grid_context=256, context_token_s=-1e-6)


def test_fit_context_cost_recovers_the_coefficients_and_never_goes_negative():
    cells = [(1, 1), (1, 8), (4, 1), (4, 8)]
    deltas = [768 * (0.5e-6 * r + 1.2e-6 * r * k) for r, k in cells]
    assert fit_context_cost(cells, deltas, 768) == pytest.approx((0.5e-6, 1.2e-6))
    # a machine where more requests made context cheaper: the per-request price is dropped, not made negative
    a, b = fit_context_cost(cells, [768 * (-0.3e-6 * r + 1.2e-6 * r * k) for r, k in cells], 768)
    assert a == 0 and b > 0
    assert fit_context_cost(cells, [-1e-3] * 4, 768) == (0.0, 0.0)


def test_measure_profile_times_context_cells_in_the_same_rounds_and_fits_them():
    clock = FakeClock()
    job = clock.job
    prof = measure_profile(job("table", lambda b: 1e-3 * b), [1], repeats=2, warmup=0,
                           grid_fn=job("grid", lambda r, k: 1e-3 * r * k), grid_requests=[1, 4], grid_tokens=[1, 8],
                           context_fn=job("long", lambda r, k: 1e-3 * r * k + 1000 * (2e-6 * r + 3e-6 * r * k)),
                           context_cells=[(1, 1), (4, 8), (2, 2)], context_tokens=(256, 1256), timer=clock)
    assert prof.grid_context == 256 and prof.prices_context
    assert (prof.context_request_s, prof.context_token_s) == pytest.approx((2e-6, 3e-6))
    assert [o for o in clock.order if o[0] == "long"] == [("long", 1, 1), ("long", 4, 8)] * 2  # grid cells only
    none = measure_profile(job("table", lambda b: 1e-3 * b), [1], repeats=1, warmup=0)
    assert not none.prices_context


def test_live_prices_compare_a_step_with_its_price_at_its_context():
    from dspark.scheduling.live_profile import LiveProfile

    live = LiveProfile(CTX, min_samples=2)
    for _ in range(4):  # steps at 1,256 tokens of context taking exactly their context price: no drift
        live.observe_forward(8, 1, CTX.at_context(1256).step_s(8, 1), context=1256)
    assert live.factor("verify") == pytest.approx(1.0) and live.current is CTX
    for _ in range(4):  # the same steps judged at the grid's context would have looked like a slower machine
        live.observe_forward(8, 1, CTX.at_context(1256).step_s(8, 1))
    assert live.factor("verify") > 1.5


def _history(pol, c, n, context):
    for _ in range(2):
        assert pol.prepare(n, context=context)
        pol.select(c)


def test_async_verifies_less_where_the_context_makes_verification_dear():
    c = np.full((4, 7), 0.8)
    short, long = AsyncPolicy(CTX, min_gain=0.0), AsyncPolicy(CTX, min_gain=0.0)
    _history(short, c, 4, 256)
    _history(long, c, 4, 4000)
    short.prepare(4, context=256)
    long.prepare(4, context=4000)
    assert short.last_capacity > long.last_capacity
    assert short.sps is CTX.at_context(256) or short.sps.context == 256
    assert long.sps.context == 4000 and long.sps is long.sps  # one view per rounded context, reused
    long.prepare(4, context=4010)
    assert long.sps.context == 4000  # rounded to CONTEXT_STEP: K is not re-priced every step
    blind = AsyncPolicy(CTX, min_gain=0.0)
    _history(blind, c, 4, None)
    blind.prepare(4)
    assert blind.sps is CTX and blind.last_capacity == short.last_capacity


def test_sync_prices_algorithm_1_at_the_context():
    c = np.full((1, 7), 0.8)
    pol = SyncPolicy(CTX)
    pol.prepare(1, context=256)
    near = int(pol.select(c).sum())
    pol.prepare(1, context=6000)
    far = int(pol.select(c).sum())
    assert near > far
    pol.prepare(1)
    assert int(pol.select(c).sum()) == near  # no context given: the table as measured


def test_the_simulator_prices_steps_at_the_requests_contexts():
    tr = synthetic_traces(n_rounds=200, gamma=7, seed=0)
    runs = {p: simulate(CTX, tr, FixedPolicy(0), ClosedLoop(2, output_tokens=16, requests_per_client=4,
                                                            prompt_mix=(p,))) for p in (64, 3000)}
    # prompts are priced by the prefill fallback alike; decoding at 3,000 tokens of context costs more
    assert runs[3000].throughput_tps < runs[64].throughput_tps
    asy = {p: simulate(CTX, tr, AsyncPolicy(CTX, min_gain=0.0),
                       ClosedLoop(2, output_tokens=64, requests_per_client=4, prompt_mix=(p,))) for p in (64, 3000)}
    assert asy[3000].mean_budget < asy[64].mean_budget


def test_a_later_prompt_chunk_pays_for_attending_to_the_chunks_before_it(tmp_path):
    later = SpeedProfile((1, 32), (0.011, 0.040), grid_requests=(1, 4), grid_tokens=(1, 2, 8), grid_seconds=GRID,
                         prefill_requests=(0, 4), prefill_tokens=(16, 512), key=KEY,
                         prefill_seconds=((0.02, 0.38), (0.03, 0.40)), prefill_context_s=0.5e-6)
    first = later.step_s(0, n_requests=0, prefill=(512,))
    assert later.step_s(0, n_requests=0, prefill=((512, 0),)) == first == pytest.approx(0.38)
    assert later.step_s(0, n_requests=0, prefill=((512, 1024),)) == pytest.approx(0.38 + 0.5e-6 * 512 * 1024)
    assert later.step_s(4, n_requests=4, prefill=((512, 512), 16)) == pytest.approx(
        later.step_s(4, n_requests=4, prefill=(512, 16)) + 0.5e-6 * 512 * 512)
    assert load_cached_profile(save_profile(later, tmp_path / "p.json"), KEY).prefill_context_s == 0.5e-6


def test_measure_profile_prices_a_later_prompt_chunk_against_the_same_chunk_from_the_start():
    clock = FakeClock()
    job = clock.job
    prof = measure_profile(job("table", lambda b: 1e-3 * b), [1], repeats=2, warmup=0,
                           prefill_fn=job("prefill", lambda r, p: 1e-3 * (r + p)), prefill_requests=[0, 8],
                           prefill_tokens=[16, 512], prefill_context_at=(512, 1024), timer=clock,
                           prefill_context_fn=job("later", lambda p: 1e-3 * p + 0.4e-6 * p * 1024))
    assert prof.prefill_context_s == pytest.approx(0.4e-6)
    without = measure_profile(job("table", lambda b: 1e-3 * b), [1], repeats=1, warmup=0, timer=clock,
                              prefill_context_fn=job("later", lambda p: 1.0), prefill_context_at=(512, 1024))
    assert without.prefill_context_s == 0  # no prefill table to compare the chunk with: not priced


def test_the_simulator_prices_each_prompt_chunk_after_the_ones_before_it():
    import dataclasses

    tr = synthetic_traces(n_rounds=200, gamma=7, seed=0)
    base = SpeedProfile((1, 32), (0.011, 0.040), grid_requests=(1, 4), grid_tokens=(1, 2, 8), grid_seconds=GRID,
                        prefill_requests=(0, 4), prefill_tokens=(16, 512), key=KEY,
                        prefill_seconds=((0.02, 0.38), (0.03, 0.40)))
    later = dataclasses.replace(base, prefill_context_s=0.5e-6)
    loop = ClosedLoop(1, output_tokens=8, requests_per_client=2, prompt_mix=(1536,))
    a, b = (simulate(p, tr, FixedPolicy(0), loop, prefill_chunk=512) for p in (base, later))
    # per request: chunks after 0, 512 and 1,024 prompt tokens; the later two pay 512 x (512 + 1,024) x 0.5 us
    assert 16 / b.throughput_tps - 16 / a.throughput_tps == pytest.approx(2 * 0.5e-6 * 512 * 1536, rel=1e-6)
