"""Bounded load and fault test on loopback: concurrent streaming clients, random hang-ups, malformed requests.

Zero 5xx on valid requests, zero crashes, every completed stream equal to its non-streamed replay (same seed),
and the engine empty afterwards: no KV reserved, nothing running or waiting, no request left in its tables.
Memory: the Python heap must not grow (object count after a warm-up round vs after three more, with the finished
requests kept as prefix donors — a cache bounded by its entry limit — evicted before each count); the RSS bound
is loose on purpose, because the engine's native shape-keyed caches (oneDNN primitives) and allocator
fragmentation grow RSS for thousands of requests before they level off, in the engine alone as much as here.
"""
import asyncio
import gc

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from dspark.serving.loadtest import LoadConfig, run_load, to_markdown  # noqa: E402
from server_testlib import engine_idle, start_server  # noqa: E402


def live_objects(srv) -> int:
    srv.app.state.engine.reset_prefix_cache()
    gc.collect()
    return len(gc.get_objects())


def test_load_and_faults():
    srv = start_server(max_concurrency=32, max_queue=64, api_key="k")
    try:
        cfg = LoadConfig(url=srv.url, api_key="k", clients=48, requests=50, rounds=1, max_tokens=20, seed=1,
                         max_rss_growth_mb=64.0, strict_memory=True, out=None, deadline_s=240)
        asyncio.run(run_load(cfg))  # warm-up: thread pools, allocator arenas, lazily built caches
        before = live_objects(srv)
        cfg.rounds, cfg.seed = 3, 2
        report = asyncio.run(run_load(cfg))
        grown = live_objects(srv) - before
        s = report["summary"]
        print(to_markdown(report), f"\nPython objects grown: {grown}")
        assert s["valid_5xx"] == 0 and s["crashes"] == 0 and s["stream_error_events"] == 0, report["problems"]
        assert s["stream_vs_plain_mismatches"] == 0, report["problems"]
        assert s["server_policy"] == "fixed-4" and s["sampled_replays_not_compared"] == 0  # all compared
        assert s["malformed_expected_status"] == s["malformed_sent"] > 0, report["problems"]
        assert s["hangups"] > 0 and s["streams_completed"] > 20 and s["valid_other_4xx"] == 0
        assert s["kv_clean_after_each_round"] and engine_idle(srv)
        counters = srv.app.state.counters
        assert counters.in_flight == 0 and counters.disconnects > 0 and not srv.app.state.engine.queues
        assert grown < 2000, f"{grown} more live Python objects after 150 requests"
        assert s["passed"], report
    finally:
        srv.stop()
