"""The speed profile's prefill table: a new request's prompt priced as what it adds to the step it rides in
(measured beside 0, 8 and 32 decoding requests), not as one more request of that many tokens; measuring it,
validating it, caching it, and the serving simulator pricing prompt chunks (and prompt mixes) with it."""

import numpy as np
import pytest
from helpers import FakeClock

from dspark.scheduling import (
    ClosedLoop,
    FixedPolicy,
    ProfileKey,
    SpeedProfile,
    current_machine,
    load_cached_profile,
    measure_profile,
    save_profile,
    simulate,
    synthetic_traces,
)

KEY = ProfileKey("m", "d", current_machine(), "float32")
# Plain decoding of R requests: 10 ms + 1 ms per request (grid, k = 1 and 2). A P-token prompt adds 0.5 ms per
# token beside 8 requests, 0.4 ms beside 32, and costs 5 ms + 0.5 ms per token alone.
PREFILL = SpeedProfile((1, 64), (0.011, 0.074), grid_requests=(1, 8, 32), grid_tokens=(1, 2), key=KEY,
                       grid_seconds=((0.011, 0.012), (0.018, 0.026), (0.042, 0.074)),
                       prefill_requests=(0, 8, 32), prefill_tokens=(16, 128),
                       prefill_seconds=((0.005 + 0.008, 0.005 + 0.064), (0.018 + 0.008, 0.018 + 0.064),
                                        (0.042 + 0.0064, 0.042 + 0.0512)))


def test_a_prompt_adds_its_measured_extra_to_the_decoding_step():
    assert PREFILL.prefill_extra_s(128, 8) == pytest.approx(0.064)
    assert PREFILL.prefill_extra_s(64, 8) == pytest.approx(0.032)  # linear in the prompt
    assert PREFILL.prefill_extra_s(128, 20) == pytest.approx(0.064 - 0.5 * 0.0128)  # linear in the load
    assert PREFILL.prefill_extra_s(128, 64) == pytest.approx(0.0512)  # flat beyond the loads measured
    assert PREFILL.prefill_extra_s(8, 8) == pytest.approx(0.008)  # flat below the smallest prompt
    assert PREFILL.prefill_extra_s(256, 8) == pytest.approx(0.128)  # linear above the largest
    # the step: decoding priced by the grid, each prompt chunk's extra on top
    assert PREFILL.step_s(8, n_requests=8, prefill=(128,)) == pytest.approx(0.018 + 0.064)
    assert PREFILL.step_s(16, n_requests=8, prefill=(128, 16)) == pytest.approx(0.026 + 0.064 + 0.008)
    # no request decoding: the prompt alone, as measured
    assert PREFILL.step_s(0, n_requests=0, prefill=(128,)) == pytest.approx(0.069)
    assert PREFILL.step_s(8, n_requests=8) == pytest.approx(0.018)  # no prompt: unchanged


def test_without_a_prefill_table_a_prompt_is_one_more_request_of_its_tokens():
    plain = SpeedProfile((1, 64), (0.011, 0.074), grid_requests=(1, 8, 32), grid_tokens=(1, 2),
                         grid_seconds=PREFILL.grid_seconds)
    assert plain.step_s(8, n_requests=8, prefill=(128,)) == pytest.approx(plain.step_s(136, n_requests=9))
    table = SpeedProfile((1, 64), (0.011, 0.074))
    assert table.step_s(8, n_requests=8, prefill=(16,)) == pytest.approx(table.step_s(24))


@pytest.mark.parametrize("bad, match", [
    (dict(prefill_requests=(8, 0)), "increasing"),
    (dict(prefill_requests=(-1, 8)), ">= 1"),
    (dict(prefill_tokens=(0, 128)), ">= 1"),
    (dict(prefill_seconds=((0.01, 0.02),)), "rows"),
    (dict(prefill_seconds=((0.01, 0.02), (0.01, -1.0), (0.01, 0.02))), "> 0"),
])
def test_invalid_prefill_tables_are_refused(bad, match):
    table = dict(prefill_requests=(0, 8, 32), prefill_tokens=(16, 128), prefill_seconds=PREFILL.prefill_seconds)
    with pytest.raises(ValueError, match=match):
        SpeedProfile((1,), (0.1,), **{**table, **bad})


def test_prefill_table_survives_the_cache(tmp_path):
    assert load_cached_profile(save_profile(PREFILL, tmp_path / "p.json"), KEY) == PREFILL


def test_measure_profile_times_the_prefill_table_in_the_same_rounds():
    clock = FakeClock()
    prof = measure_profile(clock.job("table", lambda b: 1e-3 * b), [1, 2], repeats=2, warmup=0,
                           prefill_fn=clock.job("prefill", lambda r, p: 1e-3 * (r + p)), prefill_requests=[8, 0],
                           prefill_tokens=[64, 16], timer=clock)
    assert prof.prefill_requests == (0, 8) and prof.prefill_tokens == (16, 64)
    np.testing.assert_allclose(prof.prefill_seconds, [[16e-3, 64e-3], [24e-3, 72e-3]])
    one_round = [("table", 1), ("table", 2), ("prefill", 0, 16), ("prefill", 0, 64), ("prefill", 8, 16),
                 ("prefill", 8, 64)]
    assert clock.order == one_round * 2


def test_simulator_prices_prompt_chunks_by_the_prefill_table():
    # C = 1, 4 output tokens, 128-token prompts: a cycle is one prefill step alone (69 ms, which also yields the
    # first token) and three plain steps of one request (11 ms): 4 tokens per 102 ms.
    tr = synthetic_traces(n_rounds=50, gamma=3, seed=0)
    r = simulate(PREFILL, tr, FixedPolicy(0), ClosedLoop(1, output_tokens=4, n_steps=2000, prompt_tokens=128))
    assert r.throughput_tps == pytest.approx(4 / 0.102, rel=0.01)


def test_simulator_prompt_mix_is_taken_in_turn():
    # Prompts of 16 and 128 tokens alternate: cycles of 13 + 33 ms and 69 + 33 ms, 8 tokens per 148 ms.
    tr = synthetic_traces(n_rounds=50, gamma=3, seed=0)
    mix = simulate(PREFILL, tr, FixedPolicy(0), ClosedLoop(1, output_tokens=4, n_steps=2000, prompt_mix=(16, 128)))
    assert mix.throughput_tps == pytest.approx(8 / 0.148, rel=0.01)
    with pytest.raises(ValueError, match="prompt lengths"):
        simulate(PREFILL, tr, FixedPolicy(0), ClosedLoop(1, output_tokens=4, prompt_mix=(16, -1)))


def test_a_cached_profile_without_the_table_is_measured_again_only_when_the_table_is_needed(tmp_path):
    from dspark.scheduling.profile_io import load_or_measure

    path = tmp_path / "p.json"
    plain = SpeedProfile((1, 8), (0.01, 0.02), key=KEY)
    save_profile(plain, path)
    calls = []

    def measure():
        calls.append(1)
        return PREFILL

    assert load_or_measure(path, KEY, measure) == plain and not calls  # an engine takes what is cached
    needs_table = lambda p: bool(p.prefill_seconds)  # noqa: E731
    assert load_or_measure(path, KEY, measure, usable=needs_table).prefill_seconds and calls == [1]
    assert load_or_measure(path, KEY, measure, usable=needs_table) == PREFILL and calls == [1]  # cached now
