"""Simulator workloads: the benchmark's cell (C clients from a cold start sending C × n requests in all, the drain
with fewer running at the end), output lengths spread like the benchmark's, and the open loop."""

import numpy as np
import pytest

from dspark.scheduling import ClosedLoop, FixedPolicy, Poisson, SpeedProfile, simulate, synthetic_traces
from dspark.scheduling.workload import Requests

# 10 ms a step plus 10 ms per request in it, whatever it verifies: the clock counts steps and their sizes.
PER_REQUEST = SpeedProfile((1, 64), (0.02, 0.02), grid_requests=(1, 2), grid_tokens=(1, 2),
                           grid_seconds=((0.02, 0.02), (0.03, 0.03)))
TRACES = synthetic_traces(n_rounds=50, gamma=3, seed=0)


def test_requests_per_client_runs_the_benchmark_cell_and_drains():
    # Two clients, three 4-token requests each, plain decoding: 12 steps of both requests, then nothing left.
    r = simulate(PER_REQUEST, TRACES, FixedPolicy(0), ClosedLoop(2, output_tokens=4, requests_per_client=3))
    assert r.completed == 6 and r.steps == 12
    assert r.throughput_tps == pytest.approx(24 / (12 * 0.03))


def test_the_drain_with_fewer_requests_running_is_measured():
    loop = ClosedLoop(2, output_tokens=10, output_spread=0.5, requests_per_client=1)
    lengths = Requests(loop, np.random.default_rng(0), seed=0).remaining
    assert lengths.min() != lengths.max() and ((5 <= lengths) & (lengths <= 15)).all()
    r = simulate(PER_REQUEST, TRACES, FixedPolicy(0), loop, seed=0)
    short, long = sorted(lengths)
    # both run until the shorter finishes, then the longer alone
    assert r.steps == long and r.completed == 2
    assert r.sim_seconds == pytest.approx(short * 0.03 + (long - short) * 0.02)


def test_output_spread_is_seeded_and_centred():
    loop = ClosedLoop(64, output_tokens=100, output_spread=0.5, requests_per_client=1)
    a = Requests(loop, np.random.default_rng(0), seed=3).remaining
    assert (a == Requests(loop, np.random.default_rng(9), seed=3).remaining).all()  # its own stream
    assert a.min() >= 50 and a.max() <= 150 and abs(a.mean() - 100) < 10


def test_the_cold_start_prefills_every_first_prompt():
    loop = ClosedLoop(3, output_tokens=4, prompt_mix=(7, 9), requests_per_client=2)
    reqs = Requests(loop, np.random.default_rng(0))
    assert reqs.prefill.tolist() == [7, 9, 7]  # the mix in turn
    r = simulate(PER_REQUEST, TRACES, FixedPolicy(0), loop)
    assert r.completed == 6 and r.throughput_tps > 0


@pytest.mark.parametrize("bad", [dict(output_spread=1.0), dict(output_spread=-0.1), dict(requests_per_client=-1),
                                 dict(concurrency=0)])
def test_invalid_workloads_are_refused(bad):
    with pytest.raises(ValueError):
        ClosedLoop(**{"concurrency": 2, **bad})


def test_open_loop_requests_leave_and_the_run_ends():
    r = simulate(PER_REQUEST, TRACES, FixedPolicy(0), Poisson(rate=5.0, n_requests=20, output_tokens=8,
                                                               output_spread=0.25), seed=1)
    assert r.completed == 20 and r.sim_seconds > 0


def test_command_line_takes_a_prompt_mix_and_an_output_spread(tmp_path):
    from dspark.scheduling.simulator import main

    table = tmp_path / "cpu.csv"
    table.write_text("tokens,seconds\n1,0.01\n64,0.2\n512,1.0\n")
    args = ["--profile", str(table), "--concurrency", "4", "--steps", "200"]
    plain = main(args)
    mixed = main(args + ["--prompt-mix", "16,128", "--output-spread", "0.5"])
    assert mixed["none"][4].throughput_tps < plain["none"][4].throughput_tps  # prompts cost their prefill


def test_output_mix_gives_each_request_its_length_in_turn():
    from dspark.scheduling.workload import ClosedLoop as Loop, Requests

    reqs = Requests(Loop(2, output_tokens=64, output_spread=0.5, requests_per_client=2, prompt_mix=(10, 20, 30),
                         output_mix=(3, 7, 11)), np.random.default_rng(0))
    assert reqs.remaining.tolist() == [3, 7] and reqs.prefill.tolist() == [10, 20]
    reqs.advance(np.array([10, 20]), np.array([3, 1]))  # the first finishes: the third request joins
    assert reqs.remaining.tolist() == [11, 6] and reqs.prefill.tolist() == [30, 0]
    with pytest.raises(ValueError, match="output lengths"):
        Requests(Loop(1, output_mix=(0, 4)), np.random.default_rng(0))


def test_copied_prompt_tokens_are_context_but_not_prefilled():
    """cached_mix: a prompt prefix copied from another request's cache (the engine's prefix reuse) is not prefilled,
    yet the request holds the whole prompt as context; at least the last prompt token is always computed."""
    from dspark.scheduling.workload import ClosedLoop as Loop, Requests

    reqs = Requests(Loop(3, output_tokens=4, requests_per_client=2, prompt_mix=(10, 20, 30),
                         cached_mix=(0, 15, 30)), np.random.default_rng(0))
    assert reqs.prefill.tolist() == [10, 5, 1] and reqs.context.tolist() == [10, 20, 30]
    reqs.advance(np.array([10, 5, 1]), np.array([4, 1, 1]))  # the first finishes: the fourth request takes turn 0
    assert reqs.prefill.tolist() == [10, 0, 0] and reqs.context.tolist() == [10, 21, 31]
    with pytest.raises(ValueError, match="copied prompt tokens"):
        Requests(Loop(1, cached_mix=(-1,)), np.random.default_rng(0))


def test_copied_prefixes_make_the_simulated_cell_faster():
    # 10 ms a step plus 1 ms a prompt token: a fully copied 100-token prompt costs one token of prefill
    profile = SpeedProfile((1, 256), (0.01, 0.265))
    loop = dict(output_tokens=8, requests_per_client=2, prompt_mix=(100,))
    cold = simulate(profile, TRACES, FixedPolicy(0), ClosedLoop(2, **loop))
    warm = simulate(profile, TRACES, FixedPolicy(0), ClosedLoop(2, **loop, cached_mix=(99,)))
    assert warm.completed == cold.completed == 4
    assert warm.throughput_tps > 1.5 * cold.throughput_tps
