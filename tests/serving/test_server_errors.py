"""Bad input and hostile clients: OpenAI-style 4xx bodies, limits, API key, queue, disconnects, timeouts."""
import asyncio
import http.client
import json

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from dspark.serving.http_client import Connection, request, sse_stream  # noqa: E402
from server_testlib import engine_idle, start_server, wait_until  # noqa: E402

LONG = {"model": "tiny", "prompt": "Tell a long story", "max_tokens": 900, "ignore_eos": True, "temperature": 1}


def call(server, method, path, body=None, headers=None, api_key=None):
    raw = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    return asyncio.run(request(server.url, method, path, raw, api_key, headers))


@pytest.fixture(scope="module")
def server():
    srv = start_server(max_body_bytes=16384)
    yield srv
    srv.stop()


CASES = [  # (body, path, status, param, code)
    (b'{"prompt": "hi", ', "/v1/completions", 400, None, "invalid_json"),
    (b'{"prompt": "\xff\xfe"}', "/v1/completions", 400, None, "invalid_encoding"),
    (b'{"prompt": "hi", "temperature": NaN}', "/v1/completions", 400, None, "invalid_json"),
    (b"[1, 2]", "/v1/completions", 400, None, "invalid_json"),
    (b"[" * 100000 + b"]" * 100000, "/v1/completions", 413, None, "body_too_large"),
    ({"prompt": "hi", "temperature": "hot"}, "/v1/completions", 400, "temperature", "invalid_value"),
    ({"prompt": "hi", "temperature": -1}, "/v1/completions", 400, "temperature", "invalid_value"),
    ({"prompt": "hi", "top_p": 5}, "/v1/completions", 400, "top_p", "invalid_value"),
    ({"prompt": "hi", "max_tokens": 0}, "/v1/completions", 400, "max_tokens", "invalid_value"),
    ({"prompt": "hi", "max_tokens": -1, "echo": True}, "/v1/completions", 400, "max_tokens", "invalid_value"),
    ({"prompt": "hi", "echo": "yes"}, "/v1/completions", 400, "echo", "invalid_value"),
    ({"prompt": "hi", "max_tokens": 0, "echo": True, "min_tokens": 2}, "/v1/completions", 400, None, None),
    ({"prompt": "hi", "seed": 2**70}, "/v1/completions", 400, "seed", "invalid_value"),
    ({"prompt": "hi", "n": 17}, "/v1/completions", 400, "n", "invalid_value"),
    ({"prompt": "hi", "n": 0}, "/v1/completions", 400, "n", "invalid_value"),
    ({"prompt": "hi", "stop_token_ids": [-1]}, "/v1/completions", 400, "stop_token_ids", None),
    ({"prompt": "hi", "logit_bias": {"abc": 1}}, "/v1/completions", 400, "logit_bias", None),
    ({"prompt": "hi", "logit_bias": {"99999999": 1}}, "/v1/completions", 400, "logit_bias", None),
    ({"prompt": "hi", "logit_bias": {"5": 500}}, "/v1/completions", 400, None, None),
    ({"prompt": "hi", "frequency_penalty": 3}, "/v1/completions", 400, None, None),
    ({"prompt": "hi", "min_p": 1.5}, "/v1/completions", 400, "min_p", "invalid_value"),
    ({"prompt": "hi", "repetition_penalty": 0}, "/v1/completions", 400, "repetition_penalty", "invalid_value"),
    ({"prompt": "hi", "repetition_penalty": 500}, "/v1/completions", 400, None, None),
    ({"prompt": ["a", ""]}, "/v1/completions", 400, "prompt", None),
    ({"prompt": [[1, 2], []]}, "/v1/completions", 400, "prompt", None),
    ({"prompt": [[1, 2], [99999999]]}, "/v1/completions", 400, "prompt", None),
    ({"prompt": ["a"] * 65}, "/v1/completions", 400, "prompt", None),
    ({"prompt": ["a"] * 20, "n": 4}, "/v1/completions", 400, "n", None),
    ({"prompt": ["a", [1, 2]]}, "/v1/completions", 400, "prompt", None),
    ({"prompt": [1, 99999999]}, "/v1/completions", 400, "prompt", None),
    ({"prompt": ""}, "/v1/completions", 400, "prompt", None),
    ({"prompt": "hi", "stop": ["a"] * 20}, "/v1/completions", 400, "stop", None),
    ({"prompt": "hi", "logprobs": 21}, "/v1/completions", 400, "logprobs", None),
    ({"prompt": "hi", "logprobs": True}, "/v1/completions", 400, "logprobs", None),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": 3}, "/v1/chat/completions", 400, "logprobs", None),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "/v1/chat/completions", 400,
     "top_logprobs", None),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, "/v1/chat/completions",
     400, "top_logprobs", "invalid_value"),
    ({"prompt": "\ud800"}, "/v1/completions", 400, "prompt", None),
    ({"model": "gpt-4", "prompt": "hi"}, "/v1/completions", 404, "model", "model_not_found"),
    ({}, "/v1/chat/completions", 400, "messages", "missing_required"),
    ({"messages": []}, "/v1/chat/completions", 400, "messages", "invalid_value"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "/v1/chat/completions", 400, "messages.0.role",
     "invalid_value"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "/v1/chat/completions", 400,
     "messages.0.content", None),
    ({"messages": [{"role": "user", "content": "word " * 1500}]}, "/v1/chat/completions", 400, "messages",
     "context_length_exceeded"),
    ({"prompt": "hi", "max_tokens": 5000}, "/v1/completions", 400, "max_tokens", "context_length_exceeded"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 5000}, "/v1/chat/completions", 400,
     "max_completion_tokens", "context_length_exceeded"),
    (b'{"prompt": "hi", "temperature": 1e999}', "/v1/completions", 400, "temperature", "invalid_value"),
    ({"prompt": "hi", "stream": "yes"}, "/v1/completions", 400, "stream", "invalid_value"),
    ({}, "/tokenize", 400, None, "invalid_value"),
    ({"prompt": "hi", "messages": [{"role": "user", "content": "x"}]}, "/tokenize", 400, None, "invalid_value"),
    ({"model": "gpt-4", "prompt": "hi"}, "/tokenize", 404, "model", "model_not_found"),
    ({"prompt": "\ud800"}, "/tokenize", 400, "prompt", None),
    ({"tokens": [1, -2]}, "/detokenize", 400, "tokens", None),
    ({"tokens": [99999999]}, "/detokenize", 400, "tokens", None),
    ({"tokens": "12"}, "/detokenize", 400, "tokens", "invalid_value"),
]


@pytest.mark.parametrize("body,path,status,param,code", CASES, ids=[str(i) for i in range(len(CASES))])
def test_bad_requests_get_openai_style_errors(server, body, path, status, param, code):
    reply = call(server, "POST", path, body)
    assert reply.status == status, reply.body
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param and (code is None or error["code"] == code)
    assert error["type"] == ("invalid_request_error" if status in (400, 404, 413) else error["type"])


def test_limits_routes_and_client_exceptions(server):
    assert call(server, "POST", "/v1/completions", headers={"Content-Length": str(10**9)}).status == 413
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("POST", "/v1/completions", body=iter([b"{\"prompt\": \"" + b"a" * 4000] * 8), encode_chunked=True)
    assert conn.getresponse().status == 413  # chunked: no Content-Length to judge by, cut while reading
    conn.close()
    for method, path, status in (("GET", "/v1/nope", 404), ("GET", "/v1/completions", 405)):
        reply = call(server, method, path)
        assert reply.status == status and reply.json()["error"]["message"]
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="hi", n=30)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "hi"}])
    assert call(server, "GET", "/health").status == 200  # and still serving
    assert engine_idle(server)


def test_api_key_is_required_when_configured():
    srv = start_server(api_key="s3cret")
    try:
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
        assert call(srv, "POST", "/v1/completions", body).status == 401
        reply = call(srv, "POST", "/v1/completions", body, api_key="wrong")
        assert reply.status == 401 and reply.json()["error"]["type"] == "authentication_error"
        assert reply.headers["www-authenticate"] == "Bearer"
        assert call(srv, "GET", "/metrics").status == 401
        assert call(srv, "GET", "/health").status == 200  # liveness probes need no key
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="s3cret", max_retries=0)
        assert client.completions.create(model="tiny", prompt="hi", max_tokens=2).usage.completion_tokens == 2
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{srv.url}/v1", api_key="s3cre", max_retries=0).models.list()
    finally:
        srv.stop()


async def _open_stream(url, payload, events=2):
    """Start a stream, read a few events, and return the open connection (the caller hangs up)."""
    conn = Connection(url)
    stream = sse_stream(conn, "/v1/completions", {**payload, "stream": True})
    async for status, _ in stream:
        assert status == 200
        events -= 1
        if events == 0:
            return conn, stream


def test_queue_full_gets_429_and_disconnect_frees_kv_at_once():
    srv = start_server(max_concurrency=1, max_queue=0)
    try:
        async def scenario():
            conn, stream = await _open_stream(srv.url, LONG)
            assert srv.app.state.engine.engine.kv_reserved > 0
            busy = await request(srv.url, "POST", "/v1/completions", json.dumps(LONG).encode())
            assert busy.status == 429 and int(busy.headers["retry-after"]) >= 1
            assert busy.json()["error"]["type"] == "rate_limit_error"
            conn.close()  # hang up mid-stream
            await stream.aclose()
            return busy
        asyncio.run(scenario())
        assert wait_until(lambda: engine_idle(srv), timeout=3), "KV not freed after the client hung up"
        # a non-streamed request whose client leaves is cancelled too
        async def plain_hangup():
            conn = Connection(srv.url)
            task = asyncio.ensure_future(conn.send("POST", "/v1/completions", json.dumps(LONG).encode()))
            await asyncio.sleep(0.5)
            assert srv.app.state.engine.engine.kv_reserved > 0
            task.cancel()
            conn.close()
        asyncio.run(plain_hangup())
        assert wait_until(lambda: engine_idle(srv), timeout=3)
        assert call(srv, "POST", "/v1/completions", {**LONG, "max_tokens": 3}).status == 200  # slot free again
    finally:
        srv.stop()


def test_per_request_timeout():
    srv = start_server(timeout_s=0.4)
    try:
        reply = call(srv, "POST", "/v1/completions", LONG)
        assert reply.status == 408 and reply.json()["error"]["code"] == "timeout"

        async def streamed():
            return [e async for _, e in sse_stream(Connection(srv.url), "/v1/completions", {**LONG, "stream": True})]
        events = asyncio.run(streamed())
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "timeout"
        assert wait_until(lambda: engine_idle(srv), timeout=3)
    finally:
        srv.stop()


def test_n_choices_all_freed_on_hangup_and_timeout():
    """Every engine request of an n = 3 request is cancelled when its client hangs up mid-stream, and when the
    per-request timeout cuts it (plain: 408; streamed: the error event, then [DONE])."""
    srv = start_server(max_concurrency=4)
    try:
        async def hangup():
            conn, stream = await _open_stream(srv.url, {**LONG, "n": 3})
            assert len(srv.app.state.engine.engine.requests) == 3
            conn.close()
            await stream.aclose()
        asyncio.run(hangup())
        # 10 s, not 3: in one full-suite run (session 32) the engine was not idle within 3 s on the 2-core
        # machine; alone it passed 7 times in 7, 4 of them beside a CPU-bound process. wait_until returns as soon
        # as the engine is idle, so a passing run waits no longer.
        assert wait_until(lambda: engine_idle(srv), timeout=10), "KV not freed after the client hung up"
    finally:
        srv.stop()
    srv = start_server(timeout_s=0.4, max_concurrency=4)
    try:
        reply = call(srv, "POST", "/v1/completions", {**LONG, "n": 3})
        assert reply.status == 408 and reply.json()["error"]["code"] == "timeout"

        async def streamed():
            return [e async for _, e in sse_stream(Connection(srv.url), "/v1/completions",
                                                   {**LONG, "n": 3, "stream": True})]
        events = asyncio.run(streamed())
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "timeout"
        assert wait_until(lambda: engine_idle(srv), timeout=3)
    finally:
        srv.stop()
