"""The load test's clients: a mix of valid requests (streamed, hung up, or plain) and malformed ones, each run
against the server and tallied. `loadtest.py` runs rounds of them and checks the server afterwards."""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

from .http_client import Connection, request, sse_stream

WORDS = "sea river code proof list tree graph prime sort cache token queue light stone bird".split()


@dataclass
class Tally:
    valid_sent: int = 0
    served: int = 0  # valid requests answered in full (stream to [DONE], or a 200 JSON body)
    streams_completed: int = 0
    hangups: int = 0
    rate_limited: int = 0  # 429s (retried after Retry-After)
    gave_up: int = 0  # valid requests still refused with 429 after 5 tries
    valid_5xx: int = 0
    valid_other_4xx: int = 0
    stream_errors: int = 0  # an error event inside a 200 stream of a valid request
    connection_errors: int = 0
    malformed_sent: int = 0
    malformed_ok: int = 0  # answered with the expected 4xx status
    mismatches: int = 0
    replayed: int = 0  # completed streams re-asked without streaming (not counted in `served`)
    replay_skipped: int = 0  # sampled streams not compared: the server's policy depends on the load
    problems: list = field(default_factory=list)  # the first few details, for the report
    latencies: list = field(default_factory=list)

    def problem(self, text: str) -> None:
        if len(self.problems) < 20:
            self.problems.append(text)


def valid_payload(rng: random.Random, model: str, max_tokens: int) -> tuple[str, dict]:
    chat = rng.random() < 0.5
    topic = " ".join(rng.choices(WORDS, k=rng.randint(2, 6)))
    payload = {"model": model, "max_tokens": rng.randint(4, max_tokens), "seed": rng.randrange(2**31),
               "temperature": rng.choice([0.0, 0.7, 1.0])}
    if rng.random() < 0.3:
        payload["top_p"] = 0.9
    if rng.random() < 0.3:
        payload["top_k"] = 20
    if rng.random() < 0.3:
        payload["stop"] = rng.choice([[" the"], ["\n\n", "."], "e"])
    if rng.random() < 0.15:
        payload["n"] = rng.choice([2, 3])
    if rng.random() < 0.2:
        payload.update({"logprobs": True, "top_logprobs": 2} if chat else {"logprobs": 2})
    if rng.random() < 0.15:  # vLLM's sampling extensions
        payload.update(rng.choice([{"min_p": 0.05}, {"repetition_penalty": 1.2}]))
    if chat:
        payload["messages"] = [{"role": "user", "content": f"Tell me about {topic}."}]
        return "/v1/chat/completions", payload
    payload["prompt"] = f"A short note on {topic}:"
    if rng.random() < 0.1:  # a batch of prompts: n answers each
        payload["prompt"] = [payload["prompt"], f"Three facts about {topic}:"]
    if rng.random() < 0.2:  # the prompt echoed (and scored, with logprobs); max_tokens 0: scored alone
        payload.update(echo=True, **({"max_tokens": 0} if rng.random() < 0.3 else {}))
    return "/v1/completions", payload


def malformed(rng: random.Random, model: str, max_len: int, api_key: str | None):
    """-> (name, expected status, method, path, body bytes or None, extra headers, send the key?)"""
    c, ch = "/v1/completions", "/v1/chat/completions"
    cases = [("invalid_json", 400, "POST", c, b'{"model": "x", ', {}),
             ("not_utf8", 400, "POST", c, b'{"prompt": "\xff\xfe\xfd"}', {}),
             ("nan", 400, "POST", c, b'{"prompt": "hi", "temperature": NaN}', {}),
             ("wrong_type", 400, "POST", c, json.dumps({"prompt": "hi", "temperature": "hot"}).encode(), {}),
             ("n_too_many", 400, "POST", c, json.dumps({"prompt": "hi", "n": 99}).encode(), {}),
             ("bad_top_p", 400, "POST", ch, json.dumps({"messages": [{"role": "user", "content": "x"}],
                                                         "top_p": 5}).encode(), {}),
             ("missing_messages", 400, "POST", ch, b"{}", {}),
             ("array_body", 400, "POST", c, b"[]", {}),
             ("unknown_model", 404, "POST", c, json.dumps({"model": model + "-nope", "prompt": "hi"}).encode(), {}),
             ("too_long", 400, "POST", c, json.dumps({"prompt": [5] * (max_len + 5), "max_tokens": 4}).encode(), {}),
             ("oversized", 413, "POST", c, None, {"Content-Length": str(10**9)}),
             ("wrong_method", 405, "GET", c, None, {})]
    name, status, method, path, body, headers = rng.choice(cases)
    if api_key and rng.random() < 0.2:
        return "no_api_key", 401, "POST", c, b'{"prompt": "hi"}', {}, False
    return name, status, method, path, body, headers, True


async def _stream(cfg, path: str, payload: dict, hang_after: int | None, tally: Tally):
    """-> ((text per choice), (finish_reason per choice), usage) of a completed stream, or None (hung up / failed /
    rate limited)."""
    payload = {**payload, "stream": True, "stream_options": {"include_usage": True}}
    prompts = payload.get("prompt")
    batch = isinstance(prompts, list) and prompts and isinstance(prompts[0], (str, list))  # not one prompt of ids
    n = payload.get("n", 1) * (len(prompts) if batch else 1)  # answers: prompts × n
    for _ in range(5):
        conn, usage, events = Connection(cfg.url, cfg.api_key), None, 0
        text, finish = [[] for _ in range(n)], [None] * n
        try:
            async for status, event in sse_stream(conn, path, payload):
                if status == 429:
                    tally.rate_limited += 1
                    break
                if status != 200:
                    tally.valid_5xx += status >= 500
                    tally.valid_other_4xx += status < 500
                    tally.problem(f"{path} stream -> {status}: {event}")
                    return None
                if event == "[DONE]":
                    return tuple("".join(t) for t in text), tuple(finish), usage
                if "error" in event:
                    tally.stream_errors += 1
                    tally.problem(f"{path} stream error event: {event['error']}")
                    return None
                events += 1
                for choice in event.get("choices", []):
                    i = choice["index"]
                    text[i].append(choice.get("delta", {}).get("content") or choice.get("text") or "")
                    finish[i] = choice.get("finish_reason") or finish[i]
                usage = event.get("usage") or usage
                if hang_after is not None and events >= hang_after:
                    tally.hangups += 1
                    return None
            else:
                tally.connection_errors += 1
                tally.problem(f"{path} stream ended without [DONE]")
                return None
        finally:
            conn.close()
        await asyncio.sleep(0.2 + random.random() * 0.5)  # rate limited: back off, then retry
    tally.gave_up += 1
    return None


async def plain(cfg, path: str, payload: dict, tally: Tally):
    for _ in range(5):
        reply = await request(cfg.url, "POST", path, json.dumps(payload).encode(), cfg.api_key)
        if reply.status == 429:
            tally.rate_limited += 1
            await asyncio.sleep(min(2.0, float(reply.headers.get("retry-after", "1"))) * random.random())
            continue
        if reply.status != 200:
            tally.valid_5xx += reply.status >= 500
            tally.valid_other_4xx += reply.status < 500
            tally.problem(f"{path} -> {reply.status}: {reply.body[:200]!r}")
            return None
        body = reply.json()
        choices = body["choices"]
        texts = tuple(c["message"]["content"] if "message" in c else c["text"] for c in choices)
        return texts, tuple(c["finish_reason"] for c in choices), body["usage"]
    tally.gave_up += 1
    return None


async def run_job(cfg, job, tally: Tally, completed: list) -> None:
    """Run one job; a completed stream is appended to `completed` as (path, payload, (text, finish, usage))."""
    kind, *rest = job
    start = time.perf_counter()
    try:
        if kind == "bad":
            name, expected, method, path, body, headers, with_key = rest
            tally.malformed_sent += 1
            reply = await request(cfg.url, method, path, body, cfg.api_key if with_key else None, headers)
            # The prompt's length is known only after tokenizing, which happens after admission: when the
            # queue is full, 429 is the right answer for it as well.
            if reply.status == expected or (name == "too_long" and reply.status == 429):
                tally.malformed_ok += 1
            else:
                tally.problem(f"malformed {name}: expected {expected}, got {reply.status}")
            return
        path, payload = rest
        tally.valid_sent += 1
        if kind == "plain":
            result = await plain(cfg, path, payload, tally)
        else:
            result = await _stream(cfg, path, payload, random.randint(1, 4) if kind == "hangup" else None, tally)
            if result is not None:
                tally.streams_completed += 1
                completed.append((path, payload, result))
        if result is not None:
            tally.served += 1
            tally.latencies.append(time.perf_counter() - start)
    except (OSError, ConnectionError, asyncio.IncompleteReadError, TimeoutError) as exc:
        tally.connection_errors += kind != "bad"
        tally.problem(f"{kind}: {type(exc).__name__}: {exc}")
