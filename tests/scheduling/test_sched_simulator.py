"""Serving simulator with the synthetic GPU-like profile: fixed K = 7 falls below plain decoding at high load while
the asynchronous scheduler stays within 3 % of (or above) the best fixed K at every concurrency."""

import numpy as np
import pytest

from dspark.scheduling import (
    AcceptanceTraces,
    AsyncPolicy,
    Calibration,
    ClosedLoop,
    FixedPolicy,
    Poisson,
    SpeedProfile,
    format_sweep,
    from_rollouts,
    gpu_like_profile,
    simulate,
    sweep,
    synthetic_traces,
)

CONCURRENCY = (1, 8, 64, 256)


@pytest.fixture(scope="module")
def results():
    return sweep(gpu_like_profile(), synthetic_traces(20_000, seed=0), CONCURRENCY, n_steps=300, seed=0)


def best_fixed(results, c):
    fixed = [name for name in results if name in ("none", "mtp1") or name.startswith("fixed-")]
    return max(results[name][c].throughput_tps for name in fixed)


def test_fixed_7_falls_below_no_speculation_at_high_load(results):
    assert results["fixed-7"][256].throughput_tps < results["none"][256].throughput_tps
    assert results["fixed-7"][1].throughput_tps > 3 * results["none"][1].throughput_tps  # and wins alone


@pytest.mark.parametrize("c", CONCURRENCY)
def test_async_scheduler_at_least_097_of_best_fixed_k(results, c):
    assert results["async"][c].throughput_tps >= 0.97 * best_fixed(results, c), format_sweep(results)


def test_sync_scheduler_close_to_best_fixed_k(results):
    # Algorithm 1 needs this step's confidences, so it always pays for drafting; at C = 256 that costs ~2.5 %.
    for c in CONCURRENCY:
        assert results["sync"][c].throughput_tps >= 0.95 * best_fixed(results, c)


def test_budget_shrinks_with_load(results):
    budgets = [results["async"][c].mean_budget for c in CONCURRENCY]
    assert budgets[0] == pytest.approx(7.0) and budgets[-1] < 0.5
    assert budgets == sorted(budgets, reverse=True)
    for c in CONCURRENCY:
        r = results["fixed-3"][c]
        assert r.mean_budget == 3.0 and r.per_user_tps == pytest.approx(r.throughput_tps / c)


def test_simulation_is_deterministic_and_tau_matches_traces():
    prof, tr = gpu_like_profile(), synthetic_traces(5000, seed=1)
    a = simulate(prof, tr, FixedPolicy(7), ClosedLoop(4, 128, 200), seed=3)
    b = simulate(prof, tr, FixedPolicy(7), ClosedLoop(4, 128, 200), seed=3)
    assert a == b
    assert a.tau == pytest.approx(tr.tau(), rel=0.05)
    assert a.mean_batch_tokens == 32 and a.steps == 200


def test_poisson_arrivals():
    prof, tr = gpu_like_profile(), synthetic_traces(5000, seed=2)
    low = simulate(prof, tr, AsyncPolicy(prof), Poisson(rate=0.5, n_requests=30, output_tokens=64), seed=0)
    high = simulate(prof, tr, AsyncPolicy(prof), Poisson(rate=2000.0, n_requests=400, output_tokens=64), seed=0)
    assert low.completed == 30 and high.completed == 400
    assert low.per_user_tps > 150  # alone on the machine: full blocks, ~τ/20 ms
    assert high.mean_budget < low.mean_budget  # busy machine: shorter verification


def test_traces_from_rollouts_and_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    L = rng.normal(1.0, 2.0, size=(100, 7))
    n = rng.integers(0, 8, size=100)
    cal = Calibration((2.0,) * 7)
    tr = from_rollouts(L, n, cal)
    np.testing.assert_allclose(tr.conf, cal.apply(L))
    back = AcceptanceTraces.load(tr.save(tmp_path / "traces.npz"))
    assert np.array_equal(back.conf, tr.conf) and np.array_equal(back.n_acc, tr.n_acc)
    with pytest.raises(ValueError, match="0..7"):
        AcceptanceTraces(tr.conf, np.full(100, 8))


def test_sweep_plot(results, tmp_path):
    pytest.importorskip("matplotlib")
    from dspark.scheduling import write_sweep_plot

    out = write_sweep_plot(results, tmp_path / "sweep.png", title="synthetic GPU-like profile")
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_command_line_sweep(tmp_path, capsys):
    from dspark.scheduling.simulator import main

    table = tmp_path / "cpu.csv"
    table.write_text("tokens,seconds\n1,0.08\n16,0.10\n64,0.29\n256,0.68\n")  # DESIGN.md §3 CPU numbers
    res = main(["--profile", str(table), "--concurrency", "1,4", "--steps", "30", "--out", str(tmp_path / "o")])
    assert set(res["async"]) == {1, 4}
    assert "| async | 4 |" in capsys.readouterr().out
    assert (tmp_path / "o" / "sweep.md").read_text().startswith("profile: user table")
    assert (tmp_path / "o" / "sweep.json").exists()


def test_prefill_rides_in_the_step_and_costs_its_tokens():
    # Step cost 10 ms per token; C = 1, 4 output tokens, 96-token prompts: a cycle is one 0.96 s prefill step
    # (which also yields the first token) and three 10 ms decoding steps -> 4 tokens per 0.99 s.
    prof = SpeedProfile((1, 1000), (0.01, 10.0), (1, 2), (1e-3, 1e-3))  # plain decoding never drafts
    tr = synthetic_traces(n_rounds=50, gamma=3, seed=0)
    r = simulate(prof, tr, FixedPolicy(0), ClosedLoop(1, output_tokens=4, n_steps=4000, prompt_tokens=96))
    assert r.throughput_tps == pytest.approx(4 / 0.99, rel=0.01)
    assert r.tau == 1.0  # prefill steps are not decoding rounds
    # A 1000-token prompt is prefilled in chunks of 512 and 488 tokens: two steps, 10 s in all.
    long = simulate(prof, tr, FixedPolicy(0), ClosedLoop(1, output_tokens=4, n_steps=4000, prompt_tokens=1000),
                    prefill_chunk=512)
    assert long.throughput_tps == pytest.approx(4 / 10.03, rel=0.01)
    assert long.mean_batch_tokens == pytest.approx((512 + 488 + 3) / 5, rel=0.01)


def test_prefill_lowers_throughput_more_at_high_concurrency():
    prof = gpu_like_profile()
    tr = synthetic_traces(n_rounds=200, gamma=7, seed=1)
    ratio = {}
    for c in (1, 64):
        plain = simulate(prof, tr, FixedPolicy(0), ClosedLoop(c, output_tokens=64))
        with_prompt = simulate(prof, tr, FixedPolicy(0), ClosedLoop(c, output_tokens=64, prompt_tokens=512))
        ratio[c] = with_prompt.throughput_tps / plain.throughput_tps
    assert ratio[64] < ratio[1] <= 1.0


def test_walk_replays_each_requests_rounds_in_recorded_order():
    """With walk, every request shows the policy the round after the one it showed last step (from its own random
    start, wrapping at the end); new requests of a closed loop and open-loop arrivals start afresh. Without it the
    rounds come in no order."""
    m, gamma = 500, 3
    conf = np.repeat((np.arange(m) / m)[:, None], gamma, axis=1)  # round i's confidences all read i / m
    traces = AcceptanceTraces(conf, np.zeros(m, dtype=np.int64))

    class Spy:  # verifies one draft a request, and notes which round each request showed
        needs_confidence, name = True, "spy"

        def prepare(self, n_requests):
            return True

        def select(self, c, **kw):
            shown.append(np.rint(c[:, 0] * m).astype(int))
            return np.ones(c.shape[0], dtype=np.int64)

    for arrival in (ClosedLoop(3, 40, requests_per_client=3), Poisson(rate=200.0, n_requests=12, output_tokens=40)):
        for walk in (True, False):
            shown = []
            simulate(gpu_like_profile(), traces, Spy(), arrival, seed=2, walk=walk)
            steps = [(a, b) for a, b in zip(shown, shown[1:]) if a.size == b.size]  # mostly the same requests
            follows = np.mean([np.mean((b - a) % m == 1) for a, b in steps])
            assert (follows > 0.9) if walk else (follows < 0.1), (arrival, walk, follows)
