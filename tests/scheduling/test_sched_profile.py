"""Speed profile: interpolation/extrapolation, measuring, the keyed cache (round trip, stale key -> None with a
warning), and user-supplied tables whose errors name the bad line."""

import dataclasses
import json
import warnings

import numpy as np
import pytest

from dspark.scheduling import (
    ProfileFormatError,
    ProfileKey,
    SpeedProfile,
    current_machine,
    load_cached_profile,
    load_profile_table,
    measure_profile,
    save_profile,
)

KEY = ProfileKey("HuggingFaceTB/SmolLM2-135M-Instruct", "dspark-markov", current_machine(), "float32")
PROF = SpeedProfile((1, 16, 64), (0.08, 0.10, 0.30), (1, 64), (0.04, 0.10), key=KEY, source="test")


def test_interpolation_and_extrapolation():
    assert PROF.step_s(1) == pytest.approx(0.08)
    assert PROF.step_s(8) == pytest.approx(0.08 + 7 / 15 * 0.02)  # linear in time between points
    assert PROF.step_s(40) == pytest.approx(0.20)
    assert PROF.step_s(128) == pytest.approx(0.30 + 64 * 0.2 / 48)  # last slope continues above the table
    flat = SpeedProfile(PROF.tokens, PROF.seconds, extrapolate="flat")
    assert flat.step_s(128) == pytest.approx(0.30)
    assert SpeedProfile((4, 8), (0.1, 0.2)).step_s(1) == pytest.approx(0.1)  # flat below the first point
    np.testing.assert_allclose(PROF.step_s(np.array([1, 40])), [0.08, 0.20])
    assert PROF.sps(16) == pytest.approx(10.0)
    assert PROF.sps(16, n_requests=64) == pytest.approx(1 / 0.2)  # drafting cost of 64 requests added
    assert PROF.draft_s(32) == pytest.approx(0.04 + 31 / 63 * 0.06)
    assert SpeedProfile((1,), (0.1,)).draft_s(10) == 0.0
    assert isinstance(PROF.step_s(3), float)


def test_negative_slope_is_not_extrapolated_below_zero():
    p = SpeedProfile((1, 2), (0.2, 0.1))
    assert p.step_s(1000) == pytest.approx(0.1)


@pytest.mark.parametrize(
    "tokens, seconds, match",
    [((), (), "non-zero"), ((1, 1), (0.1, 0.1), "increasing"), ((0,), (0.1,), ">= 1"), ((1,), (0.0,), "> 0"),
     ((1, 2), (0.1,), "same")],
)
def test_invalid_tables(tokens, seconds, match):
    with pytest.raises(ValueError, match=match):
        SpeedProfile(tokens, seconds)


class FakeClock:
    """A clock that only the fake jobs advance, recording which job ran with what, in order."""

    def __init__(self):
        self.now, self.order = 0.0, []

    def __call__(self) -> float:
        return self.now

    def job(self, *tag, cost):
        def run(*args):
            self.order.append((*tag, *args))
            self.now += cost(*args)
        return run

    def jobs(self) -> list:
        """The order of an untagged one-argument job: its arguments."""
        return [args[0] for args in self.order]


def test_measure_profile_takes_median():
    now = [0.0]  # fake clock, advanced by the fake step function
    durations = {4: [0.5, 0.1, 0.2], 8: [0.3, 0.3, 9.0]}
    calls = {4: 0, 8: 0}

    def timer():
        return now[0]

    def step(b):
        if calls[b] >= 1:  # first call is the warm-up and is not timed
            now[0] += durations[b][calls[b] - 1]
        calls[b] += 1

    prof = measure_profile(step, [8, 4], repeats=3, warmup=1, timer=timer)
    assert prof.tokens == (4, 8)
    assert prof.seconds == pytest.approx((0.2, 0.3))  # medians; the 9 s outlier is ignored
    assert prof.source == "measured"


def test_measure_profile_interleaves_repeats_so_drift_hits_every_point():
    # Every step costs 1 s, except that the machine runs at half speed for the first 6 timed calls. Timed back to
    # back, B = 1 would take all 5 of its repeats in the slow phase and B = 2 one of them (a 2x bend in the
    # curve); interleaved, each takes 3 of 5 and both medians agree.
    now, timed, order = [0.0], [0], []

    def timer():
        return now[0]

    def step(b):
        order.append(b)
        if len(order) > 2:  # past the two warm-up calls
            now[0] += 2.0 if timed[0] < 6 else 1.0
            timed[0] += 1

    prof = measure_profile(step, [1, 2], repeats=5, warmup=1, timer=timer)
    assert order[2:] == [1, 2] * 5
    assert prof.seconds[0] == prof.seconds[1] == pytest.approx(2.0)


def test_step_cost_counts_requests_when_the_caller_knows_them():
    # Measured with 4 tokens per request, so B = 32 was 8 requests; each request costs 5 ms on top of its tokens.
    p = SpeedProfile((1, 4, 32), (0.02, 0.03, 0.09), (1,), (0.01,), segment_seconds=0.005, tokens_per_segment=4)
    assert p.step_s(32) == pytest.approx(0.09)  # no R given: as measured
    assert p.step_s(32, n_requests=8) == pytest.approx(0.09)
    assert p.step_s(32, n_requests=1) == pytest.approx(0.09 - 7 * 0.005)  # one request verifying 31 drafts
    assert p.step_s(32, n_requests=16) == pytest.approx(0.09 + 8 * 0.005)
    assert p.step_s(4, n_requests=1) == pytest.approx(0.03)
    assert p.step_s(2, n_requests=2) == pytest.approx(0.02 + 0.01 / 3 + 0.005)
    np.testing.assert_allclose(p.step_s(np.array([4, 32]), n_requests=1), [0.03, 0.055])
    assert p.sps(32, n_requests=1) == pytest.approx(1 / (0.055 + 0.01))  # drafting cost of 1 request added
    assert SpeedProfile((1, 64), (0.02, 0.03), segment_seconds=0.01, tokens_per_segment=4).step_s(
        64, n_requests=1) == pytest.approx(0.02)  # never below the smallest measured step
    assert PROF.step_s(40, n_requests=3) == PROF.step_s(40)  # no request model: R changes nothing
    with pytest.raises(ValueError, match="segment_seconds"):
        SpeedProfile((1,), (0.1,), segment_seconds=-1.0)


def test_measure_profile_prices_one_more_request():
    # A step costs 1 ms per token plus 3 ms per request: B = 8 split 4 per request is 8 + 6 ms, one request 8 + 3.
    now = [0.0]

    def timer():
        return now[0]

    def split(b):
        now[0] += 1e-3 * b + 3e-3 * max(1, b // 4)

    def one(b):
        now[0] += 1e-3 * b + 3e-3

    prof = measure_profile(split, [1, 4, 8], repeats=3, one_segment_fn=one, tokens_per_segment=4, timer=timer)
    assert prof.seconds == pytest.approx((4e-3, 7e-3, 14e-3))
    assert prof.segment_seconds == pytest.approx(3e-3) and prof.tokens_per_segment == 4
    assert prof.step_s(8, n_requests=1) == pytest.approx(11e-3)
    plain = measure_profile(split, [1, 4, 8], repeats=1, timer=timer)
    assert plain.segment_seconds == 0.0 and plain.tokens_per_segment == 0


def test_cache_round_trip(tmp_path):
    path = save_profile(PROF, tmp_path / "profiles" / "sps.json")
    back = load_cached_profile(path, KEY)
    assert back == PROF
    assert back.step_s(40) == PROF.step_s(40)
    assert json.loads(path.read_text())["version"] == 15
    deep = SpeedProfile(PROF.tokens, PROF.seconds, PROF.draft_requests, PROF.draft_seconds, key=KEY,
                        shallow_draft_seconds=(0.01, 0.05), draft_depth=7)
    assert load_cached_profile(save_profile(deep, tmp_path / "deep.json"), KEY) == deep
    every = dataclasses.replace(deep, draft_depth=4, depth_draft_seconds=((0.02, 0.06), (0.021, 0.07)))
    back = load_cached_profile(save_profile(every, tmp_path / "every.json"), KEY)
    assert back == every and back.draft_s(2, depth=3) == every.draft_s(2, depth=3)
    seg = SpeedProfile((1, 8), (0.02, 0.04), segment_seconds=0.003, tokens_per_segment=4, key=KEY)
    assert load_cached_profile(save_profile(seg, tmp_path / "seg.json"), KEY) == seg
    assert load_cached_profile(save_profile(GRID, tmp_path / "grid.json"), KEY) == GRID


# 1 or 4 requests verifying 1, 2 or 4 tokens each; the table says 1 s per step whatever B, so any price that is
# not 1 s comes from the grid.
GRID = SpeedProfile((1, 16), (1.0, 1.0), grid_requests=(1, 4), grid_tokens=(1, 2, 4), key=KEY,
                    grid_seconds=((0.010, 0.012, 0.016), (0.013, 0.020, 0.030)))


def test_grid_prices_requests_and_tokens_per_request():
    assert GRID.step_s(4, n_requests=4) == pytest.approx(0.013)  # plain decoding of 4 requests, as measured
    assert GRID.step_s(16, n_requests=4) == pytest.approx(0.030)
    assert GRID.step_s(12, n_requests=4) == pytest.approx(0.025)  # k = 3: half way between k = 2 and 4
    assert GRID.step_s(2, n_requests=2) == pytest.approx(0.011)  # R = 2: a third of the way from R = 1 to 4
    assert GRID.step_s(8, n_requests=1) == pytest.approx(0.024)  # k = 8: the last k slope continues
    assert GRID.step_s(8, n_requests=8) == pytest.approx(0.017)  # R = 8: the last R slope continues
    assert GRID.step_s(1, n_requests=4) == pytest.approx(0.013)  # fewer tokens than requests: plain decoding
    assert GRID.step_s(4) == pytest.approx(1.0)  # without R: the table
    np.testing.assert_allclose(GRID.step_s(np.array([4, 8, 16]), n_requests=4), [0.013, 0.020, 0.030])
    assert isinstance(GRID.step_s(6, n_requests=2), float)
    falling = SpeedProfile((1,), (1.0,), grid_requests=(1,), grid_tokens=(1, 2), grid_seconds=((0.02, 0.01),))
    assert falling.step_s(4, n_requests=1) == pytest.approx(0.01)  # a falling last slope is not extrapolated


@pytest.mark.parametrize("grid, match", [
    (dict(grid_requests=(1, 2), grid_tokens=(1,), grid_seconds=((0.1,),)), "2 rows"),
    (dict(grid_requests=(2, 1), grid_tokens=(1,), grid_seconds=((0.1,), (0.1,))), "increasing"),
    (dict(grid_requests=(1,), grid_tokens=(1,), grid_seconds=((0.0,),)), "> 0"),
    (dict(grid_requests=(1,), grid_tokens=(1, 2), grid_seconds=((0.1,),)), "1 rows of 2")])
def test_invalid_grids(grid, match):
    with pytest.raises(ValueError, match=match):
        SpeedProfile((1,), (0.1,), **grid)


def test_drafting_priced_from_the_table_of_each_depth():
    # R = 1 and 3; depths 1, 2, 3, 4 = full. Depth 2 costs almost what depth 1 does (a kernel route), which the
    # line through depths 1 and 4 would price at a third of the way to depth 4.
    prof = SpeedProfile((1, 8), (0.01, 0.02), (1, 3), (0.008, 0.014), shallow_draft_seconds=(0.002, 0.005),
                        draft_depth=4, depth_draft_seconds=((0.0021, 0.0052), (0.005, 0.010)))
    linear = dataclasses.replace(prof, depth_draft_seconds=())
    assert prof.draft_s(1, depth=2) == pytest.approx(0.0021)
    assert linear.draft_s(1, depth=2) == pytest.approx(0.002 + 0.006 / 3)
    assert prof.draft_s(2, depth=3) == pytest.approx((0.005 + 0.010) / 2)  # between R = 1 and 3, at depth 3
    assert prof.draft_s(1, depth=2.5) == pytest.approx((0.0021 + 0.005) / 2)  # between whole depths
    np.testing.assert_allclose(prof.draft_s(3, depth=np.array([1, 2, 3, 4, 9])),
                               [0.005, 0.0052, 0.010, 0.014, 0.014])  # past the full depth: the full table
    np.testing.assert_allclose(prof.draft_s(np.array([1, 3]), depth=np.array([4, 1])), [0.008, 0.005])
    assert prof.draft_s(1) == pytest.approx(0.008)  # no depth: the full block
    assert prof.sps(2, n_requests=1, depth=2) == pytest.approx(1 / (prof.step_s(2, 1) + 0.0021))


@pytest.mark.parametrize("rows, match", [
    (((0.002, 0.005),), "one row per depth 2 .. 3"),  # depth 3 is missing
    (((0.002,), (0.003, 0.004)), "row of depth 2 needs 2 values"),
    (((0.002, 0.005), (0.003, float("nan"))), "depth-3 drafting cost table"),
])
def test_bad_depth_tables_are_refused(rows, match):
    with pytest.raises(ValueError, match=match):
        SpeedProfile((1, 8), (0.01, 0.02), (1, 3), (0.008, 0.014), shallow_draft_seconds=(0.002, 0.005),
                     draft_depth=4, depth_draft_seconds=rows)
    with pytest.raises(ValueError, match="needs the depth-1 table"):
        SpeedProfile((1, 8), (0.01, 0.02), (1, 3), (0.008, 0.014), draft_depth=4,
                     depth_draft_seconds=((0.002, 0.005), (0.003, 0.004)))


def test_measure_profile_times_the_grid_interleaved_with_the_table():
    clock = FakeClock()
    step = clock.job("table", cost=lambda b: 1e-3 * b)
    grid = clock.job("grid", cost=lambda r, k: 1e-3 * (10 * r + k))

    def draft(depth):
        return clock.job("draft", depth, cost=lambda r: 1e-4 * (depth * 10 + r))

    prof = measure_profile(step, [1, 4], repeats=2, warmup=0, grid_fn=grid, grid_requests=[2, 1],
                           grid_tokens=[4, 1], draft_fn=draft(7), shallow_draft_fn=draft(1), draft_depth=7,
                           request_counts=[2, 1], timer=clock)
    assert prof.seconds == pytest.approx((1e-3, 4e-3))
    assert prof.grid_requests == (1, 2) and prof.grid_tokens == (1, 4)
    np.testing.assert_allclose(prof.grid_seconds, [[11e-3, 14e-3], [21e-3, 24e-3]])
    assert prof.draft_requests == (1, 2) and prof.draft_seconds == pytest.approx((71e-4, 72e-4))
    assert prof.shallow_draft_seconds == pytest.approx((11e-4, 12e-4))
    # every round times the table, the grid and the drafter once each, so drift cannot tilt one against another
    one_round = [("table", 1), ("table", 4), ("grid", 1, 1), ("grid", 1, 4), ("grid", 2, 1), ("grid", 2, 4),
                 ("draft", 7, 1), ("draft", 7, 2), ("draft", 1, 1), ("draft", 1, 2)]
    assert clock.order == one_round * 2


def test_reference_step_takes_the_drift_out_of_close_prices():
    # The machine changes speed (1.45 <-> 1) after each long job, which runs between jobs a (10 ms) and b (11 ms):
    # a is timed in the slow phase 3 rounds of 5, b in the fast one, so raw medians price b under a. Read against
    # the reference job (5 ms), timed again before a job once 0.05 s have passed, every ratio is exact.
    class Drifting(FakeClock):
        slow = True

        def job(self, *tag, cost):
            def run(*args):
                self.order.append((*tag, *args))
                self.now += cost(*args) * (1.45 if self.slow else 1.0)
                self.slow ^= cost(*args) >= 1.0
            return run

    def measure(every):
        clock = Drifting()
        cost = {1: 0.005, 2: 0.010, 3: 1.9, 4: 0.011}  # per round: the reference, a, the long job, b
        step = clock.job(cost=lambda b: cost[b])
        return measure_profile(step, [1, 2, 3, 4], repeats=5, warmup=0, timer=clock, reference_every=every)

    raw, read = measure(0.0), measure(0.05)
    assert raw.seconds[3] < raw.seconds[1]  # b priced under a: the drift decided
    assert read.seconds[3] / read.seconds[1] == pytest.approx(1.1)
    assert read.seconds[1] / read.seconds[0] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="reference_every"):
        measure(-1.0)


def test_measure_profile_times_drafting_at_every_depth():
    clock = FakeClock()
    step = clock.job("table", cost=lambda b: 1e-3 * b)
    by_depth = clock.job("draft", cost=lambda r, d: 1e-4 * (d * 10 + r))

    prof = measure_profile(step, [1, 4], repeats=2, warmup=0, draft_fn=lambda r: by_depth(r, 4),
                           shallow_draft_fn=lambda r: by_depth(r, 1), depth_draft_fn=by_depth, draft_depth=4,
                           request_counts=[2, 1], timer=clock)
    assert prof.draft_seconds == pytest.approx((41e-4, 42e-4))
    assert prof.shallow_draft_seconds == pytest.approx((11e-4, 12e-4))
    np.testing.assert_allclose(prof.depth_draft_seconds, [[21e-4, 22e-4], [31e-4, 32e-4]])  # depths 2 and 3
    assert prof.draft_s(2, depth=3) == pytest.approx(32e-4)


def test_cheap_jobs_get_more_samples_in_sub_rounds():
    # A 10 ms step fits 3 samples in 35 ms, a 40 ms one 1; the cap holds a 1 ms one to 4. Extra samples come in
    # sub-rounds over all cheap jobs, never back to back, so drift still lands on every job alike.
    clock = FakeClock()
    step = clock.job(cost=lambda b: {1: 1e-3, 2: 10e-3, 3: 40e-3}[b])
    prof = measure_profile(step, [1, 2, 3], repeats=2, warmup=1, timer=clock, min_job_seconds=0.035,
                           max_samples_per_round=4)
    one_round = [1, 2, 3, 1, 2, 1, 2, 1]
    assert clock.jobs() == [1, 1, 2, 2, 3, 3] + one_round * 2  # two warm-up calls each: the fastest sets the count
    assert prof.seconds == pytest.approx((1e-3, 10e-3, 40e-3))
    with pytest.raises(ValueError, match="max_samples_per_round"):
        measure_profile(step, [1], max_samples_per_round=0)


def test_shuffled_rounds_visit_every_job_once_in_changing_orders():
    clock = FakeClock()
    step = clock.job(cost=lambda b: 1e-3 * b)
    prof = measure_profile(step, [1, 2, 3, 4], repeats=6, warmup=0, timer=clock, shuffle_seed=0)
    rounds = [tuple(clock.jobs()[i:i + 4]) for i in range(0, 24, 4)]
    assert all(sorted(r) == [1, 2, 3, 4] for r in rounds) and len(set(rounds)) > 1
    assert prof.seconds == pytest.approx((1e-3, 2e-3, 3e-3, 4e-3))
    clock.order.clear()
    measure_profile(step, [1, 2, 3, 4], repeats=6, warmup=0, timer=clock, shuffle_seed=0)
    assert [tuple(clock.jobs()[i:i + 4]) for i in range(0, 24, 4)] == rounds  # seeded: the same orders again


def test_table_points_that_are_grid_cells_are_read_from_the_grid():
    clock = FakeClock()
    step, grid = clock.job("table", cost=lambda b: 1e-3 * b), clock.job("grid", cost=lambda r, k: 1e-3 * r * k)
    prof = measure_profile(step, [1, 2, 3], repeats=2, warmup=0, grid_fn=grid, grid_requests=[1], grid_tokens=[1, 2],
                           table_cell=lambda b: (1, b), timer=clock)
    assert prof.seconds == pytest.approx((1e-3, 2e-3, 3e-3))  # B = 3 is no grid cell: timed on its own
    assert ("table", 1) not in clock.order and ("table", 2) not in clock.order
    assert clock.order.count(("table", 3)) == 2


def test_drafting_cost_is_linear_in_depth_between_the_two_tables():
    prof = SpeedProfile((1, 8), (0.01, 0.02), (1, 9), (0.007, 0.016), shallow_draft_seconds=(0.001, 0.004),
                        draft_depth=7)
    assert prof.draft_s(1) == pytest.approx(0.007)  # no depth: the full block
    assert prof.draft_s(1, 1) == pytest.approx(0.001) and prof.draft_s(1, 7) == pytest.approx(0.007)
    assert prof.draft_s(1, 4) == pytest.approx(0.004)  # half way in depth: half way in cost
    assert prof.draft_s(1, 12) == pytest.approx(0.007)  # never more than the full block
    np.testing.assert_allclose(prof.draft_s(5, np.array([1, 7])), [0.0025, 0.0115])
    np.testing.assert_allclose(prof.sps(4, n_requests=1, depth=np.array([1, 7])),
                               1 / (prof.step_s(4, 1) + np.array([0.001, 0.007])))
    assert SpeedProfile((1, 8), (0.01, 0.02), (1, 9), (0.007, 0.016)).draft_s(1, 1) == pytest.approx(0.007)
    with pytest.raises(ValueError, match="draft_depth"):
        SpeedProfile((1, 8), (0.01, 0.02), (1, 9), (0.007, 0.016), shallow_draft_seconds=(0.001, 0.004))


def test_cache_missing_is_silent(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_cached_profile(tmp_path / "nope.json", KEY) is None


@pytest.mark.parametrize("field", ["model_id", "drafter_id", "machine", "dtype", "kernels"])
def test_cache_key_mismatch_warns_and_returns_none(tmp_path, field):
    path = save_profile(PROF, tmp_path / "sps.json")
    other = ProfileKey(**{**KEY.as_dict(), field: "something else"})
    with pytest.warns(UserWarning, match=f"different setup.*{field}"):
        assert load_cached_profile(path, other) is None


@pytest.mark.parametrize("text", ["{not json", json.dumps({"format": "dspark.speed_profile", "version": 0})])
def test_cache_corrupt_or_old_version_warns_and_returns_none(tmp_path, text):
    path = tmp_path / "sps.json"
    path.write_text(text)
    with pytest.warns(UserWarning, match="re-profiling"):
        assert load_cached_profile(path, KEY) is None


def test_user_csv_table(tmp_path):
    path = tmp_path / "h200.csv"
    path.write_text("# measured on a GPU\ntokens,seconds,note\n128,0.021,knee\n1,0.020,\n\n1024,0.150,\n")
    prof = load_profile_table(path)
    assert prof.tokens == (1, 128, 1024)  # rows in any order
    assert prof.step_s(576) == pytest.approx(0.021 + 448 / 896 * 0.129)
    assert "h200.csv" in prof.source


@pytest.mark.parametrize(
    "body, match",
    [
        ("tokens,seconds\n1,0.02\n8,fast\n", "line 3"),
        ("tokens,seconds\n1,0.02\n\n8,0.02,extra\n", "line 4"),
        ("tokens,seconds\n1,0.02\n2.5,0.02\n", "line 3.*integer"),
        ("tokens,seconds\n1,0.02\n2,-1\n", "line 3.*> 0"),
        ("tokens,seconds\n4,0.02\n4,0.03\n", "line 3.*repeats line 2"),
        ("B,time\n1,0.02\n", "line 1.*header"),
        ("# only a comment\n", "empty"),
    ],
)
def test_user_csv_errors_name_the_line(tmp_path, body, match):
    path = tmp_path / "t.csv"
    path.write_text(body)
    with pytest.raises(ProfileFormatError, match=match):
        load_profile_table(path)


def test_user_json_table(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"rows": [{"tokens": 1, "seconds": 0.02}, {"tokens": 256, "seconds": 0.05}],
                                "draft": [{"requests": 1, "seconds": 0.001}]}))
    prof = load_profile_table(path, key=KEY)
    assert prof.tokens == (1, 256) and prof.draft_s(50) == pytest.approx(0.001) and prof.key == KEY


@pytest.mark.parametrize(
    "text, match",
    [
        ('[{"tokens": 1, "seconds": 0.02},\n {"tokens": 2, "secs": 0.02}]', r"row 2 \(entry \[1\]\)"),
        ('[{"tokens": 1, "seconds": 0.02},\n {"tokens": 2 "seconds": 0.02}]', "line 2"),
        ('{"rows": 5}', "list"),
    ],
)
def test_user_json_errors(tmp_path, text, match):
    path = tmp_path / "t.json"
    path.write_text(text)
    with pytest.raises(ProfileFormatError, match=match):
        load_profile_table(path)


def test_load_or_measure_measures_once_then_uses_the_cache(tmp_path):
    from dspark.scheduling import load_or_measure

    calls = []

    def measure():
        calls.append(1)
        return SpeedProfile((1, 8), (0.05, 0.06), source="measured")

    path = tmp_path / "sps.json"
    first = load_or_measure(path, KEY, measure)
    second = load_or_measure(path, KEY, measure)
    assert len(calls) == 1 and first == second and second.key == KEY
    other = ProfileKey(**{**KEY.as_dict(), "dtype": "bfloat16"})
    with pytest.warns(UserWarning, match="dtype"):
        load_or_measure(path, other, measure)  # another dtype: re-profiled and re-cached
    assert len(calls) == 2 and load_cached_profile(path, other) is not None


def test_profiles_cached_before_the_kernels_field_count_as_torch_kernels(tmp_path):
    """A cache written before the native kernel existed is valid for the torch path, stale for the native one."""
    path = save_profile(PROF, tmp_path / "sps.json")
    obj = json.loads(path.read_text())
    del obj["key"]["kernels"]
    path.write_text(json.dumps(obj))
    assert load_cached_profile(path, KEY) is not None
    with pytest.warns(UserWarning, match="kernels"):
        assert load_cached_profile(path, ProfileKey(**{**KEY.as_dict(), "kernels": "native"})) is None


def test_engine_table_points_map_to_the_grid_cells_running_the_same_step():
    from dspark.engine.profiling import GRID_TOKENS, PROFILE_REQUESTS, PROFILE_TOKENS, _split, table_cell

    for b in PROFILE_TOKENS:
        cell = table_cell(b)
        assert cell is None or [cell[1]] * cell[0] == _split(b)
    pooled = [b for b in PROFILE_TOKENS if table_cell(b) in {(r, k) for r in PROFILE_REQUESTS for k in GRID_TOKENS}]
    assert pooled == [1, 2, 4, 8, 16, 32, 64]  # 12, 24, 48 are 3, 6, 12 requests: timed on their own


def test_low_load_steps_are_timed_until_their_prices_are_precise():
    # Every grid cell and the proposals of 8 requests scatter by 8 % (sd) from one sample to the next; only the
    # steps of <= 2 requests are timed further, until each median's error is under 1 % (~100 samples) or the extra
    # time runs out (at most the rounds' own time: a 0.64 s table point makes them ~9 s). A steady job needs no
    # extra sample.
    clock = FakeClock()
    rng = np.random.default_rng(0)
    noisy = lambda base: base * (1 + 0.08 * rng.standard_normal())  # noqa: E731
    grid = clock.job("grid", cost=lambda r, k: noisy(1e-3 * (10 * r + k)))
    draft = clock.job("draft", cost=lambda r: noisy(1e-4 * r) if r > 1 else 1e-4)
    kw = dict(repeats=10, warmup=0, grid_fn=grid, grid_requests=[1, 2, 8], grid_tokens=[1, 2], draft_fn=draft,
              request_counts=[1, 8], timer=clock, shuffle_seed=0, precise_requests=2)
    table = clock.job("table", cost=lambda b: 1e-3 * b)
    prof = measure_profile(table, [1, 640], precise_seconds=60.0, **kw)
    counts = {tag: clock.order.count(tag) for tag in set(clock.order)}
    assert counts[("grid", 8, 1)] == counts[("grid", 8, 2)] == counts[("draft", 8)] == 10  # under load: the rounds
    assert counts[("draft", 1)] == counts[("table", 640)] == 10  # steady / under load
    assert all(60 < counts[("grid", r, k)] < 400 for r in (1, 2) for k in (1, 2))
    assert prof.source.startswith("measured (steps of <= 2 requests to ±")
    np.testing.assert_allclose(prof.grid_seconds[:2], [[11e-3, 12e-3], [21e-3, 22e-3]], rtol=0.03)  # 3 errors
    assert 8.5 < clock.now < 2 * 10 * 0.95  # the rounds (~0.9 s each), and no more than that again

    clock.order.clear()
    start = clock.now
    off = measure_profile(table, [1, 640], **kw)  # no extra time: off
    rounds = clock.now - start
    assert off.source == "measured" and all(n == 10 for n in map(clock.order.count, set(clock.order)))
    start = clock.now  # a short budget stops the extra sub-rounds when it runs out, mid-round if need be
    short = measure_profile(table, [1, 640], precise_seconds=0.5, **kw)
    assert clock.now - start < 1.2 * rounds + 0.5 + 0.03
    assert float(short.source.split("±")[1].split()[0]) > 1.0  # the error it could not reach, said
    for bad in (dict(precise_requests=-1), dict(precise_seconds=-1.0), dict(precision=0.0)):
        with pytest.raises(ValueError, match="precise_requests"):
            measure_profile(clock.job(cost=lambda b: 1e-3), [1], **{**kw, **bad})
