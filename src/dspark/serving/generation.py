"""Running one request: the plain JSON answer, the SSE stream, and the disconnect watch shared by both.

A client that goes away cancels its request at once: both paths race the generation against the ASGI
`http.disconnect` message rather than waiting to notice a failed write, which for a request still queued or
holding back text could be many steps later. Cancelling aborts the engine request, whose KV the next step frees.
"""
from __future__ import annotations

import asyncio
import json
import time
from typing import AsyncIterator, Callable

from .errors import APIError, ClientGone
from .logprobs import LogprobFormatter
from .protocol import Generation


async def wait_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def race_disconnect(work, receive):
    """Await `work` (a coroutine) unless the client disconnects first; then cancel it and raise ClientGone."""
    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(wait_disconnect(receive))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watch):
            t.cancel()
    if task in done:
        return task.result()
    await asyncio.gather(task, return_exceptions=True)  # let its cleanup (the abort) run before we answer
    raise ClientGone()


def failure(req, timed_out: bool = False) -> APIError:
    """The error for a request that ended without an answer (timeout, shutdown, engine failure)."""
    if timed_out:
        return APIError(408, "the request exceeded the server's per-request timeout", None, "timeout")
    if req.finish_reason == "abort":
        return APIError(503, "the server is shutting down; the request was cancelled", None, "shutting_down")
    return APIError(500, f"generation failed: {req.error or 'engine error'}", None, "engine_error")


class Responder:
    """Builds OpenAI-shaped bodies for one request; `spec_stats` rides along as the `speculative` field."""

    def __init__(self, gen: Generation, request_id: str, model: str, tokenizer=None):
        self.gen, self.id, self.model, self.created = gen, request_id, model, int(time.time())
        self.outcome: str | None = None  # "timeout" when the per-request timeout cut the stream
        chat = gen.kind == "chat"
        self.logprobs = LogprobFormatter(tokenizer, chat) if gen.params.logprobs is not None else None
        self.object = "chat.completion" if chat else "text_completion"
        self.chunk_object = "chat.completion.chunk" if chat else "text_completion"

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _logprobs(self, entries) -> dict | None:
        return None if self.logprobs is None else self.logprobs.body(entries or [])

    def final(self, req) -> dict:
        choice = {"index": 0, "finish_reason": req.finish_reason, "logprobs": self._logprobs(req.logprobs)}
        if self.gen.kind == "chat":
            choice["message"] = {"role": "assistant", "content": req.text}
        else:
            choice["text"] = req.text
        return {**self._head(self.object), "choices": [choice], "usage": req.usage(),
                "speculative": req.spec_stats()}

    def chunk(self, text: str | None = None, finish_reason: str | None = None, role: bool = False,
              logprobs=None) -> dict:
        """logprobs: the TokenLogprob entries this chunk carries (None: none, or the request asked for none)."""
        choice = {"index": 0, "finish_reason": finish_reason,
                  "logprobs": None if logprobs is None else self._logprobs(logprobs)}
        if self.gen.kind == "chat":
            choice["delta"] = {"role": "assistant", "content": ""} if role else \
                ({} if text is None else {"content": text})
        else:
            choice["text"] = text or ""
        return {**self._head(self.chunk_object), "choices": [choice]}

    def usage_chunk(self, req) -> dict:
        return {**self._head(self.chunk_object), "choices": [], "usage": req.usage(),
                "speculative": req.spec_stats()}


async def collect(engine, req, queue, timeout: float | None) -> None:
    """Drive a non-streamed request to its end; raises APIError if it ends without an answer."""
    try:
        async for _ in engine.stream(req, queue, timeout):
            pass
    except TimeoutError:
        raise failure(req, timed_out=True) from None
    if req.finish_reason not in ("stop", "length"):
        raise failure(req)


def sse(obj) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


async def sse_events(engine, req, queue, responder: Responder, timeout: float | None) -> AsyncIterator[bytes]:
    """The SSE body. With stop strings, the last (longest stop - 1) characters are held back until the engine has
    seen the following tokens: a stop string may begin in them, and the OpenAI contract (and our equality with
    the non-streamed answer) is that no part of a stop string is ever sent."""
    gen = responder.gen
    hold = max((len(s) for s in gen.stop), default=1) - 1
    text, sent = "", 0
    pending: list | None = [] if responder.logprobs is not None else None  # entries seen, not sent yet
    lp_sent = 0  # entries sent
    if gen.kind == "chat":
        yield sse(responder.chunk(role=True))
    try:
        async for out in engine.stream(req, queue, timeout):
            if out.finished:
                break
            text += out.new_text
            if pending is not None and out.new_logprobs:
                pending += out.new_logprobs
            if len(text) - hold > sent:
                yield sse(responder.chunk(text[sent: len(text) - hold], logprobs=pending))
                lp_sent += len(pending or ())
                sent, pending = len(text) - hold, None if pending is None else []
    except TimeoutError:
        responder.outcome = "timeout"
        yield sse(failure(req, timed_out=True).body())
        yield sse(b"[DONE]")
        return
    if req.finish_reason not in ("stop", "length"):
        yield sse(failure(req).body())
        yield sse(b"[DONE]")
        return
    if pending is not None:  # the request has finished: its entries are final, the finishing step's included
        pending = req.logprobs[lp_sent:]
    if len(req.text) > sent or pending:  # the final text (cut before a stop string) minus what already went out
        yield sse(responder.chunk(req.text[sent:], logprobs=pending))
    last = responder.chunk(None if gen.kind == "chat" else "", finish_reason=req.finish_reason)
    last["speculative"] = req.spec_stats()
    yield sse(last)
    if gen.include_usage:
        yield sse(responder.usage_chunk(req))
    yield sse(b"[DONE]")


class SSEResponse:
    """An ASGI response that streams `events` and watches for the client leaving; `on_close` always runs
    (completion, disconnect or error) with whether the client left; it aborts the engine request if still running."""

    headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[bool], None]):
        self.events, self.on_close = events, on_close

    async def _pump(self, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.headers})
        async for chunk in self.events:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope, receive, send) -> None:
        gone = False
        try:
            await race_disconnect(self._pump(send), receive)
        except (ClientGone, OSError):
            gone = True  # nobody is left to tell
        finally:
            try:
                await self.events.aclose()
            finally:
                self.on_close(gone)
