"""`dspark calibrate` and `dspark bench acceptance` on a tiny random target (no SmolLM2, no ../shared)."""
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "training"))
from tiny_target import make_target_dir  # noqa: E402

from dspark.bench.acceptance import AcceptanceConfig, conditional_acceptance, run_engine, tau_of  # noqa: E402
from dspark.calibrate import CalibrateConfig, run as calibrate  # noqa: E402
from dspark.drafters import make_drafter  # noqa: E402
from dspark.drafters.dspark_checkpoint import save_drafter  # noqa: E402
from dspark.drafters.dspark_model import DrafterArch, DSparkModel  # noqa: E402
from dspark.generate import prompt_ids  # noqa: E402
from dspark.models import load_model  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    loaded = load_model(str(make_target_dir(root / "target")))
    paths = {}
    for kind in ("dspark", "dflash"):
        arch = DrafterArch(drafter_type=kind, layer_ids=(0, 1, 2), num_layers=1, block_size=4,
                           mask_token_id=loaded.config.vocab_size - 1, head="markov" if kind == "dspark" else "none",
                           rank=8 if kind == "dspark" else 0, confidence=kind == "dspark")
        torch.manual_seed(0)
        model = DSparkModel(arch, loaded.model)
        model.init_from_target(loaded.model)
        paths[kind] = save_drafter(root / kind, model, loaded.model, target_name=str(root / "target"))
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [f"count to {i} and back"]}) + "\n" for i in range(12)))
    return root, loaded, paths, prompts


def test_conditional_acceptance_uses_full_rounds_only():
    rounds = [(7, 0), (7, 3), (7, 7), (5, 2)]
    cond = conditional_acceptance(rounds, 7)
    assert cond[0] == pytest.approx(2 / 3) and cond[1] == 1.0 and cond[3] == pytest.approx(1 / 2)
    assert tau_of(rounds) == pytest.approx((1 + 4 + 8 + 3) / 4)
    assert conditional_acceptance([(3, 1)], 7) == [None] * 7


def test_tau_at_batch_8_equals_batch_1(tiny):
    """Batched evaluation with ragged verification: each request's rounds depend only on its own seed."""
    root, loaded, paths, prompts = tiny
    drafter = make_drafter(str(paths["dspark"]), target=loaded.model)
    texts = [json.loads(line)["turns"][0] for line in prompts.read_text().splitlines()[:8]]
    ids = [("s", prompt_ids(loaded.tokenizer, t, True)) for t in texts]
    taus = {}
    for batch in (1, 8):
        cfg = AcceptanceConfig(model=str(root / "target"), gamma=4, max_new_tokens=24, batch=batch)
        reqs, _ = run_engine(loaded, drafter, ids, 1.0, cfg)
        taus[batch] = [r.accepted_hist for r in reqs]
    assert taus[1] == taus[8]


def test_calibrate_fits_on_half_and_saves_with_the_drafter(tiny, tmp_path):
    root, loaded, paths, prompts = tiny
    drafter_dir = tmp_path / "d"
    import shutil
    shutil.copytree(paths["dspark"], drafter_dir)
    summary = calibrate(CalibrateConfig(drafter=str(drafter_dir), prompts=str(prompts), model=str(root / "target"),
                                        limit=10, max_new_tokens=24, batch=5, out=tmp_path / "report"))
    assert summary["fit_rounds"] > 0 and summary["heldout_rounds"] > 0
    cal = json.loads((drafter_dir / "calibration.json").read_text())
    assert len(cal["temperatures"]) == 4 and cal["n_rounds"] == summary["heldout_rounds"]
    for name in ("calibration_metrics.md", "threshold_sweep.json", "traces.npz", "summary.json"):
        assert (tmp_path / "report" / name).is_file(), name
    with np.load(tmp_path / "report" / "traces.npz") as z:
        assert z["conf"].shape == (summary["fit_rounds"] + summary["heldout_rounds"], 4)
    calibrated = make_drafter(str(drafter_dir), target=loaded.model)
    assert calibrated.calibration is not None and calibrated.calibration.temperatures == tuple(cal["temperatures"])
    assert calibrated.calibration.shifts == tuple(cal["shifts"])
    # The raw rollouts are kept: refitting from them (temperatures only this time) runs no model and sees the
    # same rounds.
    again = calibrate(CalibrateConfig(drafter=str(drafter_dir), prompts="", out=tmp_path / "refit", shift=False,
                                      from_rollouts=tmp_path / "report" / "rollouts.npz"))
    assert (again["fit_rounds"], again["heldout_rounds"]) == (summary["fit_rounds"], summary["heldout_rounds"])
    assert again["shifts"] == [0.0] * 4 and again["requests"] == 10
    (tmp_path / "bad.npz").write_bytes(b"not an npz")
    with pytest.raises(ValueError, match="not a rollouts.npz"):
        calibrate(CalibrateConfig(drafter=str(drafter_dir), prompts="", out=tmp_path / "x",
                                  from_rollouts=tmp_path / "bad.npz"))


def test_calibrate_refuses_a_drafter_without_confidence_head(tiny, tmp_path):
    root, _, paths, prompts = tiny
    with pytest.raises(ValueError, match="no confidence head"):
        calibrate(CalibrateConfig(drafter=str(paths["dflash"]), prompts=str(prompts), model=str(root / "target"),
                                  limit=4, out=tmp_path))


def test_engine_splits_step_time_into_forwards_and_overhead(tiny):
    from dspark.decoding import SamplingParams
    from dspark.engine.engine import Engine, EngineConfig
    from dspark.scheduling.registry import make_policy

    root, loaded, paths, prompts = tiny
    drafter = make_drafter(str(paths["dspark"]), target=loaded.model)
    engine = Engine(loaded.model, loaded.tokenizer, drafter, make_policy("fixed-4"), loaded.eos_ids,
                    EngineConfig(gamma=4, max_running=4))
    reqs = [engine.add_request(prompt_ids(loaded.tokenizer, f"count to {i}", True),
                               SamplingParams(max_new_tokens=12)) for i in range(4)]
    while any(not r.finished for r in reqs):
        engine.step()
    s = engine.stats
    assert s.forward_seconds_total > 0 and s.drafter_seconds_total > 0
    assert s.forward_seconds_total + s.drafter_seconds_total <= s.step_seconds_total
    assert 0.0 <= s.overhead_fraction < 1.0


def test_head_latency_times_each_part_of_a_proposal(tiny):
    from dspark.bench.acceptance import head_latency

    root, loaded, paths, prompts = tiny
    for name, ids in (("dspark", prompt_ids(loaded.tokenizer, "count to 3", True)), ("dflash", [3, 4, 5])):
        lat = head_latency(loaded, make_drafter(str(paths[name]), target=loaded.model), ids, repeats=3)
        assert all(lat[k] > 0 for k in ("propose_ms", "backbone_ms", "lm_head_ms", "draw_ms", "verify_forward_ms"))
        assert lat["round_ms"] == lat["propose_ms"] + lat["verify_forward_ms"]
        assert 0 < lat["draw_share_of_round"] < 1
    assert head_latency(loaded, make_drafter("ngram", target=loaded.model), [3, 4, 5]) is None  # model-free


def test_speed_vs_plain_splits_each_loops_rounds_into_phases(tiny):
    """The in-loop round breakdown: phases are non-negative and add up to the round; plain decoding proposes
    nothing and emits one token a round."""
    from dspark.bench.acceptance import speed_vs_plain

    root, loaded, paths, prompts = tiny
    drafter = make_drafter(str(paths["dspark"]), target=loaded.model)
    cfg = AcceptanceConfig(model=str(root / "target"), gamma=4, max_new_tokens=12)
    speed = speed_vs_plain(loaded, drafter, [("s", prompt_ids(loaded.tokenizer, "count to 3", True))], 0.0, cfg)
    plain, spec = speed["plain_round"], speed["spec_round"]
    for r in (plain, spec):
        parts = [r[f"{k}_ms"] for k in ("propose", "forward", "verify", "observe")]
        assert min(parts) >= 0 and r["other_ms"] > -1e-6 and r["forward_ms"] > 0
        assert sum(parts) + r["other_ms"] == pytest.approx(r["round_ms"])
        assert r["ms_per_token"] == pytest.approx(r["round_ms"] / r["tokens_per_round"])
    assert plain["propose_ms"] < 0.01 and plain["tokens_per_round"] == 1  # no proposal: only the check
    assert spec["propose_ms"] > 0 and spec["tokens_per_round"] >= 1


def test_bench_serve_simulates_the_measured_cells(tiny, tmp_path, monkeypatch):
    """`dspark bench serve --traces`: every measured cell gets the simulator's prediction from this machine's
    profile (target steps and this drafter's drafting cost, measured and cached) and the recorded traces."""
    from dspark.bench.serving import ServeBenchConfig, simulated
    from dspark.scheduling.traces import AcceptanceTraces

    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path / "cache"))
    root, loaded, paths, prompts = tiny
    drafter = make_drafter(str(paths["dspark"]), target=loaded.model)
    rng = np.random.default_rng(0)
    traces = AcceptanceTraces(rng.uniform(0.2, 0.9, (200, 4)), rng.integers(0, 5, 200))
    traces.save(tmp_path / "traces.npz")
    cfg = ServeBenchConfig(model=str(root / "target"), drafter=str(paths["dspark"]), gamma=4, max_new_tokens=16,
                           traces=tmp_path / "traces.npz")
    cells = [{"policy": p, "concurrency": c} for p in ("none", "fixed-4", "async") for c in (1, 4)]
    simulated(cfg, loaded, drafter, cells, prompt_mix=(0,))
    for cell in cells:
        assert cell["sim_throughput_tok_s"] > 0 and cell["sim_tau"] >= 1.0
    # The prompts' prefill reaches the simulator with the engine's chunk size (the profile measured here is noisy
    # on a busy machine, so what prefill does to throughput is tested on fixed profiles in test_sched_simulator).
    import dspark.scheduling.simulator as sim

    seen, real = [], sim.simulate
    monkeypatch.setattr(sim, "simulate", lambda *a, **k: seen.append((a[3], k["prefill_chunk"])) or real(*a, **k))
    cfg = dataclasses.replace(cfg, requests_per_client=3, length_spread=0.25)
    simulated(cfg, loaded, drafter, cells, prompt_mix=(64, 40))
    assert len(seen) == len(cells) and all(loop.prompt_mix == (64, 40) and chunk == 512 for loop, chunk in seen)
    # the same cell as measured: as many requests per client from a cold start, the same spread of lengths
    assert all(loop.requests_per_client == 3 and loop.output_spread == 0.25 for loop, _ in seen)
    # ... and, given the measured runs, each request as long as the measured one in its place
    seen.clear()
    runs = [{**c, "repeat": 0, "output_lengths": [5, 0, 9] * c["concurrency"],
             "cached_prompt_tokens": [0, 30, 63] * c["concurrency"]} for c in cells]
    simulated(cfg, loaded, drafter, cells, prompt_mix=(64, 40), runs=runs)
    assert [loop.output_mix for loop, _ in seen] == [(5, 1, 9) * c["concurrency"] for c in cells]
    # ... and copying as many prompt tokens from other requests' caches as it did
    assert [loop.cached_mix for loop, _ in seen] == [(0, 30, 63) * c["concurrency"] for c in cells]
    assert all(c["sim_throughput_tok_s"] > 0 for c in cells)
    assert all(c["sim_mean_budget"] == 0 for c in cells if c["policy"] == "none")
    assert all(c["sim_mean_budget"] == 4 for c in cells if c["policy"] == "fixed-4")
    cached = list((tmp_path / "cache" / "profiles").glob("*.json"))
    profile = json.loads(cached[0].read_text())
    assert len(cached) == 1 and profile["draft_requests"] and profile["prefill_seconds"]  # drafting, prompts priced
    with pytest.raises(ValueError, match="γ = 4"):
        simulated(ServeBenchConfig(model=cfg.model, gamma=7, traces=cfg.traces), loaded, drafter, cells, (0,))


def test_bench_serve_measures_the_prefill_table_before_the_policies_read_the_profile(tiny, bench_data, tmp_path,
                                                                                  monkeypatch):
    """With --traces the simulator needs the prefill table; it is measured once, before the engines' policies load
    the profile, so both price steps from the same measurement (and none is measured twice)."""
    import dspark.scheduling.profile_io as profile_io
    from dspark.bench.serving import ServeBenchConfig, setup
    from dspark.scheduling.traces import AcceptanceTraces

    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path / "cache"))
    root, _, paths, _ = tiny
    measured, real = [], profile_io.load_or_measure

    def counting(path, key, measure, usable=lambda p: True):
        return real(path, key, lambda: measured.append(1) or measure(), usable)

    monkeypatch.setattr(profile_io, "load_or_measure", counting)
    monkeypatch.setattr("dspark.engine.profiling.load_or_measure", counting)
    rng = np.random.default_rng(0)
    AcceptanceTraces(rng.uniform(0.2, 0.9, (50, 4)), rng.integers(0, 5, 50)).save(tmp_path / "traces.npz")
    cfg = ServeBenchConfig(model=str(root / "target"), drafter=str(paths["dspark"]), gamma=4, max_new_tokens=8,
                           policies=("async",), concurrency=(1,), traces=tmp_path / "traces.npz")
    engines = setup(cfg)[4]
    assert measured == [1] and engines["async"].policy.sps.prefill_seconds


def test_per_user_speed_at_matched_throughput_hand_worked():
    from dspark.bench.serving import per_user_at_matched_throughput

    cells = [{"policy": "mtp1", "concurrency": 1, "throughput_tok_s": 20.0},
             {"policy": "mtp1", "concurrency": 4, "throughput_tok_s": 60.0},
             {"policy": "sync", "concurrency": 1, "throughput_tok_s": 30.0},
             {"policy": "sync", "concurrency": 2, "throughput_tok_s": 50.0},
             {"policy": "sync", "concurrency": 4, "throughput_tok_s": 70.0},
             {"policy": "none", "concurrency": 4, "throughput_tok_s": 40.0}]
    rows = per_user_at_matched_throughput(cells)
    assert [r["concurrency"] for r in rows] == [1, 4]
    assert rows[0]["sync"] is None  # sync never runs as slowly as 20 tok/s aggregate
    # 60 tok/s lies halfway between sync's C = 2 (25 tok/s per user) and C = 4 (17.5): 21.25 vs MTP-1's 15.
    assert rows[1]["sync"] == pytest.approx(21.25 / 15)
    assert rows[1]["none"] is None  # a single point cannot be interpolated


def test_repeated_cells_give_medians_and_paired_ratios_hand_worked():
    from dspark.bench.serving import median_cells, paired_ratios

    runs = [{"policy": p, "concurrency": 2, "repeat": r, "throughput_tok_s": t, "tau": 1.0}
            for p, r, t in (("none", 0, 10.0), ("fixed-3", 0, 12.0), ("async", 0, 11.0),
                            ("none", 1, 20.0), ("fixed-3", 1, 16.0), ("async", 1, 21.0),
                            ("none", 2, 15.0), ("fixed-3", 2, 15.0), ("async", 2, 15.0))]
    cells = median_cells(runs)
    assert [c["policy"] for c in cells] == ["none", "fixed-3", "async"]
    assert cells[2]["throughput_tok_s"] == 15.0 and cells[2]["throughput_min"] == 11.0
    assert cells[2]["throughput_max"] == 21.0 and cells[2]["repeats"] == 3 and "repeat" not in cells[2]
    # Paired within a repeat: 11/12, 21/20, 15/15 — not the ratio of medians (15/15).
    (row,) = paired_ratios(runs)
    assert row["vs_best_fixed"] == pytest.approx([11 / 12, 21 / 20, 1.0])
    assert row["vs_none"] == pytest.approx([1.1, 1.05, 1.0])
    # The fixed policy fastest over all repeats: none (median 15) beats fixed-3 (median 15 too: ties keep the first
    # seen), so every repeat divides by none, including repeat 0 where fixed-3 was the faster.
    assert row["best_policy"] == "none" and row["vs_best_policy"] == pytest.approx([1.1, 1.05, 1.0])
    faster = [dict(r, throughput_tok_s=r["throughput_tok_s"] + 1) for r in runs if r["policy"] == "fixed-3"]
    (row,) = paired_ratios([r for r in runs if r["policy"] != "fixed-3"] + faster)
    assert row["best_policy"] == "fixed-3" and row["vs_best_policy"] == pytest.approx([11 / 13, 21 / 17, 15 / 16])
    variant = [dict(r, policy="async:live=1", throughput_tok_s=t) for r, t in zip(runs[2::3], (22.0, 21.0, 12.0))]
    (row,) = paired_ratios(runs + variant, "async:live=1")
    assert row["vs_async"] == pytest.approx([2.0, 1.0, 0.8]) and row["vs_none"] == pytest.approx([2.2, 1.05, 0.8])


@pytest.mark.parametrize("sequential", [False, True])
def test_bench_serve_interleaves_repeats(tiny, tmp_path, monkeypatch, sequential):
    import dspark.bench.serving as serving

    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path / "cache"))
    root, loaded, paths, prompts = tiny
    monkeypatch.setattr(serving, "load_bench_prompts", lambda sets, n: [("x", f"count to {i}") for i in range(4)])
    cfg = serving.ServeBenchConfig(model=str(root / "target"), drafter=str(paths["dspark"]), gamma=4,
                                   policies=("none", "fixed-4", "async", "async:live=1"), concurrency=(1, 2),
                                   max_new_tokens=8,
                                   seconds_per_cell=0.2, repeats=2, out=tmp_path / "out", sequential=sequential)
    data = serving.run(cfg)
    order = [(r["repeat"], r["concurrency"], r["policy"]) for r in data["runs"]]
    assert order == [(rep, c, p) for rep in (0, 1) for c in (1, 2) for p in cfg.policies]
    assert len(data["cells"]) == 8 and all(c["repeats"] == 2 for c in data["cells"])
    assert all(r["seconds"] >= 0.2 and r["steps"] > 0 for r in data["runs"])
    assert [len(r["vs_best_fixed"]) for r in data["async_paired_ratios"]] == [2, 2]
    md = (tmp_path / "out" / "serving.md").read_text()
    assert "async / best fixed" in md and "async:live=1 / async" in md and "Live prices" in md
    # the profile the async policies priced steps by, recorded with the run (engine work priced in: a drafter)
    assert data["profile"]["format"] == "dspark.speed_profile" and "engine work: commit" in data["profile"]["source"]
    assert f"The schedulers' speed profile: {data['profile']['source']}" in md
    live = [c for c in data["cells"] if c["policy"] == "async:live=1"]
    assert all(c["live_plain"] > 0 and c["live_verify"] > 0 and c["live_draft"] > 0 for c in live)
    with pytest.raises(ValueError, match="repeats >= 1"):
        serving.ServeBenchConfig(repeats=0)


def test_serve_cell_counts_requests_still_running_at_its_end(tiny, monkeypatch):
    """At high concurrency a 12 s cell can end before any request finishes: speed and τ then come from the
    requests still running (their tokens so far over their time so far), not from an empty list."""
    import dspark.bench.closed_loop as closed_loop
    import dspark.bench.serving as serving
    from dspark.decoding import SamplingParams
    from dspark.engine.engine import Engine, EngineConfig
    from dspark.scheduling.registry import make_policy

    root, loaded, paths, _ = tiny
    drafter = make_drafter(str(paths["dspark"]), target=loaded.model)
    engine = Engine(loaded.model, None, drafter, make_policy("fixed-4"), (), EngineConfig(gamma=4))
    steps = {"n": 0}
    real_step = engine.step

    def step():  # end the cell after 6 steps: the clock jumps 1,000 s ahead and stays there
        steps["n"] += 1
        if steps["n"] == 6:
            frozen = closed_loop.time.perf_counter() + 1000.0
            monkeypatch.setattr(closed_loop.time, "perf_counter", lambda: frozen)
        return real_step()

    engine.step = step
    params = SamplingParams(temperature=0, max_new_tokens=100, ignore_eos=True)
    cell = serving.run_cell(engine, [[5, 6, 7, 8], [9, 10, 11]], 3, params, seconds=100.0)
    monkeypatch.undo()
    assert cell["finished_requests"] == 0
    # Each request made 4-5 rounds of up to 5 tokens in ~1,000 s; before, both were NaN / 0 with nothing finished.
    assert 0.001 < cell["per_user_tok_s"] < 0.05 and 1.0 <= cell["tau"] <= 5.0
    assert not engine.running and engine.kv_reserved == 0


def test_serve_cell_warm_up_measures_after_the_first_wave(tiny):
    """With a warm-up the cell starts measuring once every client's first request has finished; tokens made
    before that are not counted."""
    import dspark.bench.serving as serving
    from dspark.decoding import SamplingParams
    from dspark.engine.engine import Engine, EngineConfig
    from dspark.scheduling.registry import make_policy

    root, loaded, _, _ = tiny
    engine = Engine(loaded.model, None, None, make_policy("none"), (), EngineConfig(gamma=4))
    added = []
    real_add = engine.add_request
    engine.add_request = lambda *a, **k: added.append(real_add(*a, **k)) or added[-1]
    params = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    cell = serving.run_cell(engine, [[5, 6, 7, 8], [9, 10, 11]], 3, params, seconds=2.0, warmup=60.0)
    first_wave = added[:3]
    assert all(r.finish_reason == "length" for r in first_wave)
    # Everything produced inside the window: later requests only (each first-wave request finished before it).
    later = added[3:]
    assert cell["throughput_tok_s"] * cell["seconds"] <= sum(len(r.output) for r in later) + 1e-9
    assert cell["throughput_tok_s"] > 0 and cell["finished_requests"] >= 1
    with pytest.raises(ValueError, match="warmup >= 0"):
        serving.ServeBenchConfig(warmup_s=-1)


def test_interleaved_loops_keep_their_own_clocks_and_outputs(tiny):
    """Policies' closed loops stepped in turn share the target and the drafter but nothing else: every finished
    request's greedy output equals plain decoding of its prompt, each loop measures at least its budget of its own
    time, and the loops' clocks together never exceed the wall time they ran in. With a length spread every loop
    sends the same (prompt, length limit) sequence, and the limits vary."""
    import time

    from dspark.bench.closed_loop import ClosedLoop, run_loops
    from dspark.decoding import SamplingParams
    from dspark.engine import Generation, TransformerTarget
    from dspark.engine.engine import Engine, EngineConfig
    from dspark.scheduling.registry import make_policy

    root, loaded, paths, _ = tiny
    drafter = make_drafter(str(paths["dspark"]), target=loaded.model)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 3, 4, 5, 6], [7, 7, 8]]
    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    engines = [Engine(loaded.model, None, drafter if p != "none" else None, make_policy(p), (), EngineConfig(gamma=4))
               for p in ("none", "fixed-4", "fixed-2")]
    added = {i: [] for i in range(len(engines))}
    for i, engine in enumerate(engines):
        real_add = engine.add_request
        engine.add_request = lambda *a, _add=real_add, _i=i, **k: added[_i].append(_add(*a, **k)) or added[_i][-1]
    loops = [ClosedLoop(e, prompts, 3, params, length_spread=0.5) for e in engines]
    t0 = time.perf_counter()
    cells = run_loops(loops, seconds=0.3, warmup=5.0)
    wall = time.perf_counter() - t0
    assert all(loop.measured_seconds >= 0.3 for loop in loops)
    assert sum(loop.clock for loop in loops) <= wall
    assert all(c["finished_requests"] >= 1 and c["throughput_tok_s"] > 0 for c in cells)
    sent = [[(tuple(r.prompt), r.params.max_new_tokens) for r in reqs] for reqs in added.values()]
    common = min(map(len, sent))
    assert all(s[:common] == sent[0][:common] for s in sent)
    assert len({n for _, n in sent[0]}) > 1 and all(4 <= n <= 12 for _, n in sent[0])
    reference = {}
    for reqs in added.values():
        for req in (r for r in reqs if r.finish_reason == "length"):
            key = tuple(req.prompt)
            if key not in reference:
                plain = Generation(TransformerTarget(loaded.model), None, list(key),
                                   SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True))
                reference[key] = [t for chunk in plain for t in chunk]
            assert len(req.output) == req.params.max_new_tokens
            assert req.output == reference[key][: len(req.output)]
    assert len(reference) == len(prompts)
    assert cells[1]["tau"] > 1.0 and cells[0]["tau"] == 1.0
    assert all(not e.running and e.kv_reserved == 0 for e in engines)


def test_request_budget_runs_the_same_requests_for_every_policy(tiny, monkeypatch):
    """With a request budget each loop sends exactly the same first N requests, lets them drain and stops; at
    T = 0 every policy then produces the same tokens, so the cells compare time on identical work."""
    from dspark.bench.closed_loop import ClosedLoop, run_loops
    from dspark.decoding import SamplingParams
    from dspark.engine.engine import Engine, EngineConfig
    from dspark.scheduling.registry import make_policy

    root, loaded, paths, _ = tiny
    drafter = make_drafter(str(paths["dspark"]), target=loaded.model)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    loops = [ClosedLoop(Engine(loaded.model, None, d, make_policy(p), (), EngineConfig(gamma=4)), prompts, 2,
                        params, length_spread=0.5, limit=5)
             for p, d in (("none", None), ("fixed-4", drafter))]
    results = run_loops(loops, seconds=None)
    assert [r["finished_requests"] for r in results] == [5, 5]
    assert all(not loop.live and loop.sent == 5 for loop in loops)
    outputs = [sorted((tuple(r.prompt), tuple(r.output)) for r, _ in loop.done) for loop in loops]
    assert outputs[0] == outputs[1] and len(outputs[0]) == 5
    assert results[0]["throughput_tok_s"] > 0
    with pytest.raises(ValueError, match="request budget"):
        run_loops([ClosedLoop(loops[0].engine, prompts, 1, params)], seconds=None)


def test_a_closed_loop_reports_the_prompt_tokens_each_request_copied(tiny):
    """What the simulator replays: per request sent, in order, the prompt tokens it copied from another request's
    cache instead of prefilling (a recurring 20-token prompt copies 19 once a donor holds it)."""
    from dspark.bench.closed_loop import ClosedLoop, run_loops
    from dspark.decoding import SamplingParams
    from dspark.engine.engine import Engine, EngineConfig
    from dspark.scheduling.registry import make_policy

    _, loaded, _, _ = tiny
    prompts = [list(range(5, 25)), list(range(30, 40))]  # 20 tokens (shareable), 10 (under the 16-token minimum)
    engine = Engine(loaded.model, None, None, make_policy("none"), (), EngineConfig(gamma=4))
    loop = ClosedLoop(engine, prompts, 1, SamplingParams(temperature=0.0, max_new_tokens=3), limit=4)
    result = run_loops([loop], seconds=None)[0]
    assert result["cached_prompt_tokens"] == [0, 0, 19, 0]
    assert len(result["output_lengths"]) == 4
