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
from .logprobs import LogprobFormatter, joined
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
    """Builds OpenAI-shaped bodies for one HTTP request of ``n`` choices (one engine request each); ``speculative``
    rides along: per choice in its final chunk, summed over the choices in the answer and the usage chunk."""

    def __init__(self, gen: Generation, request_id: str, model: str, tokenizer=None):
        self.gen, self.id, self.model, self.created = gen, request_id, model, int(time.time())
        self.outcome: str | None = None  # "timeout" when the per-request timeout cut the stream
        self.chat = gen.kind == "chat"
        self.object = "chat.completion" if self.chat else "text_completion"
        self.chunk_object = "chat.completion.chunk" if self.chat else "text_completion"
        self.tokenizer, self._formatters = tokenizer, {}  # choice index -> LogprobFormatter (its own text_offset)

    @property
    def wants_logprobs(self) -> bool:
        return self.gen.params.logprobs is not None

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _formatter(self, index: int) -> LogprobFormatter:
        return self._formatters.setdefault(index, LogprobFormatter(self.tokenizer, self.chat))

    def _logprobs(self, entries, index: int) -> dict | None:
        if not self.wants_logprobs:
            return None
        return self._formatter(index).body(entries or [])

    def echo_text(self, req, index: int) -> str:
        """Choice index's prompt as the answer echoes it: as sent, or its token ids decoded."""
        text = self.gen.echo_texts[index // self.gen.n]
        return text if text is not None else self.tokenizer.decode(req.prompt)

    def _echo_logprobs(self, req, index: int) -> dict | None:
        return self._formatter(index).echoed(req.prompt, req.prompt_logprobs) if self.wants_logprobs else None

    def final(self, reqs) -> dict:
        choices, shown = [], not self.gen.echo_only
        for i, req in enumerate(reqs):
            echoed = self._echo_logprobs(req, i) if self.gen.echo else None
            logprobs = self._logprobs(req.logprobs if shown else [], i)
            choice = {"index": i, "finish_reason": req.finish_reason,
                      "logprobs": logprobs if echoed is None else joined(echoed, logprobs)}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": req.text}
            else:
                choice["text"] = (self.echo_text(req, i) if self.gen.echo else "") + (req.text if shown else "")
            choices.append(choice)
        return {**self._head(self.object), "choices": choices, "usage": usage(reqs, self.gen.n, shown),
                "speculative": spec_stats(reqs)}

    def echo_chunk(self, req, index: int) -> dict:
        """The first chunk of a streamed completion with echo: the prompt, and its log-probabilities if asked."""
        out = self.chunk(self.echo_text(req, index), index=index)
        out["choices"][0]["logprobs"] = self._echo_logprobs(req, index)
        return out

    def chunk(self, text: str | None = None, finish_reason: str | None = None, role: bool = False,
              logprobs=None, index: int = 0) -> dict:
        """logprobs: the TokenLogprob entries this chunk carries (None: none, or the request asked for none)."""
        choice = {"index": index, "finish_reason": finish_reason,
                  "logprobs": None if logprobs is None else self._logprobs(logprobs, index)}
        if self.chat:
            choice["delta"] = {"role": "assistant", "content": ""} if role else \
                ({} if text is None else {"content": text})
        else:
            choice["text"] = text or ""
        return {**self._head(self.chunk_object), "choices": [choice]}

    def usage_chunk(self, reqs) -> dict:
        return {**self._head(self.chunk_object), "choices": [],
                "usage": usage(reqs, self.gen.n, not self.gen.echo_only), "speculative": spec_stats(reqs)}


def usage(reqs, n: int = 1, shown: bool = True) -> dict:
    """Each prompt once (its n choices share it; its cached tokens are its first choice's), every choice's
    completion tokens (none when the answer shows none: echo with max_tokens 0)."""
    firsts = reqs[::n]
    prompt, completion = sum(len(r.prompt) for r in firsts), sum(len(r.output) for r in reqs) if shown else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(r.cached_tokens for r in firsts)}}


def spec_stats(reqs) -> dict:
    if len(reqs) == 1:
        return reqs[0].spec_stats()
    rounds, drafted, accepted = (sum(getattr(r, k) for r in reqs) for k in ("rounds", "drafted", "accepted"))
    return {"rounds": rounds, "drafted": drafted, "accepted": accepted,
            "mean_accepted_length": round((accepted + rounds) / rounds, 4) if rounds else 0.0}


async def collect(engine, req, queue, timeout: float | None) -> None:
    """Drive a non-streamed request to its end; raises APIError if it ends without an answer."""
    try:
        async for _ in engine.stream(req, queue, timeout):
            pass
    except TimeoutError:
        raise failure(req, timed_out=True) from None
    if req.finish_reason not in ("stop", "length"):
        raise failure(req)


async def collect_all(engine, reqs, queues, timeout: float | None) -> None:
    """Every choice to its end; the first failure cancels the rest (whose streams then abort their requests)."""
    tasks = [asyncio.ensure_future(collect(engine, r, q, timeout)) for r, q in zip(reqs, queues)]
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def sse(obj) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


async def choice_chunks(engine, req, queue, responder: Responder, index: int, timeout: float | None
                        ) -> AsyncIterator[dict]:
    """One choice's chunks; raises APIError if it ends without an answer. With stop strings, the last (longest
    stop - 1) characters are held back until the engine has seen the following tokens: a stop string may begin in
    them, and the OpenAI contract (and our equality with the non-streamed answer) is that no part of a stop string
    is ever sent."""
    gen = responder.gen
    hold = max((len(s) for s in gen.stop), default=1) - 1
    text, sent = "", 0
    pending: list | None = [] if responder.wants_logprobs else None  # entries seen, not sent yet
    lp_sent = 0  # entries sent
    if responder.chat:
        yield responder.chunk(role=True, index=index)
    echo, shown = gen.echo, not gen.echo_only
    try:
        async for out in engine.stream(req, queue, timeout):
            if echo:  # the prompt's log-probabilities are complete once it yields its first token
                yield responder.echo_chunk(req, index)
                echo = False
            if out.finished or not shown:
                break
            text += out.new_text
            if pending is not None and out.new_logprobs:
                pending += out.new_logprobs
            if len(text) - hold > sent:
                yield responder.chunk(text[sent: len(text) - hold], logprobs=pending, index=index)
                lp_sent += len(pending or ())
                sent, pending = len(text) - hold, None if pending is None else []
    except TimeoutError:
        responder.outcome = "timeout"
        raise failure(req, timed_out=True) from None
    if req.finish_reason not in ("stop", "length"):
        raise failure(req)
    if pending is not None:  # the request has finished: its entries are final, the finishing step's included
        pending = req.logprobs[lp_sent:] if shown else []
    if shown and (len(req.text) > sent or pending):  # the final text (cut before a stop string) minus what went out
        yield responder.chunk(req.text[sent:], logprobs=pending, index=index)
    last = responder.chunk(None if responder.chat else "", finish_reason=req.finish_reason, index=index)
    last["speculative"] = req.spec_stats()
    yield last


async def merged(streams: list[AsyncIterator[dict]]) -> AsyncIterator[dict]:
    """The items of several async iterators as they come; the first exception ends it and closes them all."""
    queue: asyncio.Queue = asyncio.Queue()
    finished = object()

    async def pump(stream):
        try:
            async for item in stream:
                await queue.put(item)
            await queue.put(finished)
        except Exception as exc:
            await queue.put(exc)

    tasks = [asyncio.ensure_future(pump(s)) for s in streams]
    try:
        left = len(streams)
        while left:
            item = await queue.get()
            if item is finished:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in streams:
            await s.aclose()


async def sse_events(engine, reqs, queues, responder: Responder, timeout: float | None) -> AsyncIterator[bytes]:
    """The SSE body: every choice's chunks (interleaved as they come when n > 1), the usage chunk if asked, [DONE].
    A choice that fails ends the stream with the error (the others are cancelled)."""
    streams = [choice_chunks(engine, r, q, responder, i, timeout) for i, (r, q) in enumerate(zip(reqs, queues))]
    try:
        async for chunk in (streams[0] if len(streams) == 1 else merged(streams)):
            yield sse(chunk)
    except APIError as exc:
        yield sse(exc.body())
        yield sse(b"[DONE]")
        return
    finally:
        for s in streams:
            await s.aclose()
    if responder.gen.include_usage:
        yield sse(responder.usage_chunk(reqs))
    yield sse(b"[DONE]")


class SSEResponse:
    """An ASGI response that streams `events` and watches for the client leaving; `on_close` always runs
    (completion, disconnect or error) with whether the client left; it aborts the engine requests still running."""

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
