"""Load and fault test against a running server: `python -m dspark.serving.loadtest --url http://127.0.0.1:8000`.

Many concurrent streaming clients, some hanging up mid-stream, with malformed requests mixed in; then every
completed stream is replayed without streaming (same seed) and must match exactly — greedy ones always, sampled
ones where the server's policy is load-independent (its /health says; under the async or sync scheduler a seeded
sampled request is a fresh draw from the same distribution when the load differs) — and /metrics must show the
engine empty again (no KV reserved, nothing running or waiting). Memory: the server's RSS is read after each
round. The first rounds warm up allocator arenas and thread pools, and a later round that reaches a new peak
batch can raise the allocator's high-water mark once; a leak instead grows every round. So the check is on the
smallest growth over rounds 2..N (four rounds by default), which a steady leak cannot hide from. It is reported
as `memory_within_bound` and gates `passed` only with --strict-memory: the engine by itself (no server) grows
its RSS for thousands of requests (native shape-keyed caches such as oneDNN's primitives, and allocator
fragmentation from per-request KV tensors) before it levels off, so a short run cannot tell that from a leak.
Targets loopback only. Writes loadtest.json and loadtest.md under --out.
"""
from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import random
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlsplit

from .http_client import request
from .loadmix import Tally, malformed, plain, run_job, valid_payload


@dataclass
class LoadConfig:
    url: str = "http://127.0.0.1:8000"
    api_key: str | None = None
    clients: int = 48  # concurrent connections
    requests: int = 80  # per round
    rounds: int = 4
    disconnect_rate: float = 0.2
    malformed_rate: float = 0.15
    max_tokens: int = 32
    seed: int = 0
    max_rss_growth_mb: float = 32.0  # per round, the smallest over rounds 2..N
    strict_memory: bool = False  # make memory_within_bound part of `passed`
    settle_s: float = 30.0  # how long the engine may take to drain after the last client
    deadline_s: float = 900.0
    out: str | None = "results/loadtest"


async def metrics(cfg: LoadConfig) -> dict[str, float]:
    """Sum of each series over its labels (enough for the gauges we check)."""
    reply = await request(cfg.url, "GET", "/metrics", api_key=cfg.api_key)
    out: Counter = Counter()
    for line in reply.body.decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.split("{", 1)[0], line.rsplit(" ", 1)[1]
            out[name] += float(value)
    return dict(out)


async def settle(cfg: LoadConfig) -> dict[str, float]:
    end, m = time.monotonic() + cfg.settle_s, {}
    while time.monotonic() < end:
        m = await metrics(cfg)
        if not any(m.get(f"dspark:{k}", 0) for k in ("kv_reserved_tokens", "num_requests_running",
                                                      "num_requests_waiting", "server_requests_in_flight")):
            break
        await asyncio.sleep(0.2)
    return m


async def run_load(cfg: LoadConfig) -> dict:
    host = urlsplit(cfg.url).hostname or ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # any other host name
        loopback = False
    if not loopback:
        raise ValueError(f"the load test only targets loopback addresses, not {host!r}")
    async with asyncio.timeout(cfg.deadline_s):
        models = (await request(cfg.url, "GET", "/v1/models", api_key=cfg.api_key)).json()["data"][0]
        model, max_len = models["id"], models.get("max_model_len", 4096)
        served_by = (await request(cfg.url, "GET", "/health", api_key=cfg.api_key)).json()
        sampled_repeat = not served_by.get("load_dependent_policy", False)
        rng, tally, rounds, t0 = random.Random(cfg.seed), Tally(), [], time.perf_counter()
        random.seed(cfg.seed)
        for r in range(cfg.rounds):
            jobs = []
            for _ in range(cfg.requests):
                x = rng.random()
                if x < cfg.malformed_rate:
                    jobs.append(("bad", *malformed(rng, model, max_len, cfg.api_key)))
                else:
                    kind = "hangup" if x < cfg.malformed_rate + cfg.disconnect_rate else \
                        rng.choice(["stream", "stream", "stream", "plain"])
                    jobs.append((kind, *valid_payload(rng, model, cfg.max_tokens)))
            completed, gate = [], asyncio.Semaphore(cfg.clients)

            async def gated(job):
                async with gate:
                    await run_job(cfg, job, tally, completed)
            await asyncio.gather(*(gated(j) for j in jobs))
            after_load = await settle(cfg)
            # Replay each completed stream without streaming: same seed, so it must be the same answer.
            async def replay(item):
                path, payload, streamed = item
                if payload.get("temperature", 1.0) > 0 and not sampled_repeat:
                    tally.replay_skipped += 1
                    return
                tally.replayed += 1
                async with gate:
                    answer = await plain(cfg, path, payload, tally)
                if answer is not None and answer[:2] != streamed[:2]:
                    tally.mismatches += 1
                    tally.problem(f"stream != plain for {payload}: {streamed[:2]!r} vs {answer[:2]!r}")
            await asyncio.gather(*(replay(c) for c in completed))
            m = await settle(cfg)
            rounds.append({"round": r + 1, "streams_replayed": len(completed),
                           "kv_reserved_after": m.get("dspark:kv_reserved_tokens"),
                           "running_after": m.get("dspark:num_requests_running"),
                           "waiting_after": m.get("dspark:num_requests_waiting"),
                           "in_flight_after": m.get("dspark:server_requests_in_flight"),
                           "kv_reserved_right_after_load": after_load.get("dspark:kv_reserved_tokens"),
                           # finished requests kept as prompt-prefix donors: bounded, not leaked (engine/prefix_cache)
                           "kv_prefix_cached_after": m.get("dspark:kv_prefix_cached_tokens"),
                           "prompt_tokens_cached": m.get("dspark:prompt_tokens_cached_total"),
                           "rss_mb": round(m.get("dspark:process_resident_memory_bytes", 0) / 2**20, 1)})
        health = await request(cfg.url, "GET", "/health", api_key=cfg.api_key)
    lat = sorted(tally.latencies) or [0.0]
    kv_clean = all(not (x["kv_reserved_after"] or x["running_after"] or x["waiting_after"] or x["in_flight_after"])
                   for x in rounds)
    deltas = [round(b["rss_mb"] - a["rss_mb"], 1) for a, b in zip(rounds, rounds[1:])]
    growth = min(deltas[1:]) if len(deltas) > 1 else None
    crashes = int(health.status != 200) + tally.connection_errors
    summary = {"requests_sent": tally.valid_sent + tally.malformed_sent, "valid_requests": tally.valid_sent,
               "served": tally.served, "streams_completed": tally.streams_completed, "hangups": tally.hangups,
               "replays": tally.replayed, "sampled_replays_not_compared": tally.replay_skipped,
               "server_drafter": served_by.get("drafter"), "server_policy": served_by.get("policy"),
               "rate_limited_429": tally.rate_limited,
               "gave_up_after_429s": tally.gave_up, "valid_5xx": tally.valid_5xx,
               "valid_other_4xx": tally.valid_other_4xx, "stream_error_events": tally.stream_errors,
               "crashes": crashes, "malformed_sent": tally.malformed_sent,
               "malformed_expected_status": tally.malformed_ok, "stream_vs_plain_mismatches": tally.mismatches,
               "kv_clean_after_each_round": kv_clean, "rss_mb_per_round": [r["rss_mb"] for r in rounds],
               "rss_growth_mb_per_round_min": growth,
               "latency_p50_s": round(lat[len(lat) // 2], 3), "latency_p95_s": round(lat[int(len(lat) * .95)], 3),
               "wall_s": round(time.perf_counter() - t0, 1)}
    summary["memory_within_bound"] = growth is None or growth <= cfg.max_rss_growth_mb
    summary["passed"] = (tally.valid_5xx == 0 and crashes == 0 and tally.mismatches == 0 and kv_clean
                         and tally.stream_errors == 0 and tally.malformed_ok == tally.malformed_sent
                         and (summary["memory_within_bound"] or not cfg.strict_memory))
    return {"config": asdict(cfg), "summary": summary, "rounds": rounds, "problems": tally.problems}


def to_markdown(report: dict) -> str:
    s = report["summary"]
    lines = ["# Load and fault test", "", f"Server: {report['config']['url']}, {report['config']['clients']} "
             f"concurrent clients, {report['config']['rounds']} rounds of {report['config']['requests']} requests.",
             "", "| measure | value |", "| --- | --- |", *(f"| {k} | {v} |" for k, v in s.items()), "",
             "| round | streams replayed | KV reserved after | KV of prefix donors | prompt tokens copied (total) "
             "| running | waiting | RSS (MB) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |",
             *(f"| {r['round']} | {r['streams_replayed']} | {r['kv_reserved_after']} | "
               f"{r.get('kv_prefix_cached_after')} | {r.get('prompt_tokens_cached')} | {r['running_after']} | "
               f"{r['waiting_after']} | {r['rss_mb']} |" for r in report["rounds"])]
    if report["problems"]:
        lines += ["", "Problems (first 20):", *(f"- {p}" for p in report["problems"])]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dspark.serving.loadtest", description=__doc__.split("\n\n")[0])
    for name, value in asdict(LoadConfig()).items():
        flag, helptext = f"--{name.replace('_', '-')}", f"default: {value}"
        if isinstance(value, bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=value, help=helptext)
        else:
            p.add_argument(flag, type=str if value is None else type(value), default=value, help=helptext)
    cfg = LoadConfig(**vars(p.parse_args(argv)))
    try:
        report = asyncio.run(run_load(cfg))
    except (OSError, ValueError) as exc:  # no server there, or a non-loopback target
        print(f"error: {exc}", file=sys.stderr)
        return 2
    md = to_markdown(report)
    print(md)
    if cfg.out:
        out = Path(cfg.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "loadtest.json").write_text(json.dumps(report, indent=2))
        (out / "loadtest.md").write_text(md)
        print(f"saved {out / 'loadtest.json'} and {out / 'loadtest.md'}", file=sys.stderr)
    return 0 if report["summary"]["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
