"""The Starlette app: routes, API-key guard, body limits, admission, and graceful drain.

`create_app(llm, ServerConfig(...))` serves an already-built `LLM`; `cli.py` builds one and runs uvicorn.
"""
from __future__ import annotations

import asyncio
import hmac
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..engine.async_engine import EngineStopped
from ..engine.engine import RequestRejected
from .bridge import ServingEngine, resident_memory_bytes
from .errors import APIError, ClientGone, bad_request
from .generation import Responder, SSEResponse, collect_all, race_disconnect, sse_events
from .metrics import ServerCounters, render
from .protocol import (ChatCompletionRequest, CompletionRequest, build_generation, check_unsupported,
                       encode_prompts, parse_request)
from .tokenize import detokenize, tokenize

OPEN_PATHS = ("/health",)  # liveness probes need no key; everything else does when one is configured


@dataclass(frozen=True)
class ServerConfig:
    model_name: str
    api_key: str | None = None
    max_concurrency: int = 16  # the engine's batch; set on the LLM's EngineConfig (max_running) by the caller
    max_queue: int = 64  # admitted requests beyond the batch; more get 429
    timeout_s: float | None = 600.0  # per request, queueing included
    max_body_bytes: int = 2 * 2**20
    default_max_tokens: int = 256
    shutdown_deadline_s: float = 30.0


class ServerState:
    def __init__(self, llm, config: ServerConfig):
        self.llm, self.config = llm, config
        self.engine = ServingEngine(llm.engine)
        self.counters = ServerCounters()
        self.tokenize_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dspark-tokenize")
        self.started = int(time.time())
        self.draining = False
        self._drain: threading.Thread | None = None
        self._drain_lock = threading.Lock()

    def begin_drain(self) -> threading.Thread:
        """Stop admitting; let in-flight requests finish until the deadline, then cancel the rest. Idempotent,
        callable from a signal handler (the blocking part runs on its own thread)."""
        with self._drain_lock:
            if self._drain is None:
                self.draining = True
                self._drain = threading.Thread(target=self.engine.close, args=(self.config.shutdown_deadline_s,),
                                               name="dspark-drain", daemon=True)
                self._drain.start()
            return self._drain


async def _submit(state: ServerState, gen, rid: str, param: str) -> list[tuple[str, object, asyncio.Queue]]:
    """One engine request per choice (the first under ``rid``); if any cannot be submitted, those that were are
    aborted before the error is answered."""
    choices = []
    try:
        for i in range(gen.choices):
            choice_id = rid if i == 0 else f"{rid}-{i}"
            prompt, params = gen.choice(i)
            req, queue = await state.engine.submit_async(prompt, params, gen.stop, request_id=choice_id)
            choices.append((choice_id, req, queue))
    except RequestRejected as exc:
        _abort(state, choices)
        state.counters.rejected["too_long"] += 1
        raise bad_request(str(exc), param, "context_length_exceeded") from None
    except EngineStopped:
        _abort(state, choices)
        raise APIError(503, "the server is shutting down", None, "shutting_down", {"Retry-After": "5"}) from None
    except BaseException:  # the client left while a choice was being submitted
        _abort(state, choices)
        raise
    return choices


def _abort(state: ServerState, choices, keep_queues: bool = False) -> None:
    for choice_id, req, _ in choices:
        if not keep_queues:
            state.engine.queues.pop(choice_id, None)
        if not req.finished:
            state.engine.abort(choice_id)


async def _generate(request: Request, schema, prefix: str) -> Response:
    state: ServerState = request.app.state.dspark
    cfg, counters = state.config, state.counters
    try:
        parsed = await parse_request(request, schema, cfg.max_body_bytes, cfg.model_name)
    except ClientGone:
        return Response(status_code=499)
    check_unsupported(parsed)
    if state.draining:
        raise APIError(503, "the server is shutting down", None, "shutting_down", {"Retry-After": "5"})
    if counters.in_flight >= cfg.max_concurrency + cfg.max_queue:
        counters.rejected["queue_full"] += 1
        raise APIError(429, f"the server's queue is full ({counters.in_flight} requests in flight); retry later",
                       None, "queue_full", {"Retry-After": "1"})
    counters.in_flight += 1
    handed_off = False  # once a stream owns the slot, its on_close gives it back
    try:
        model_cfg = state.llm.engine.model.config
        loop = asyncio.get_running_loop()
        ids, param = await loop.run_in_executor(state.tokenize_pool, encode_prompts, parsed, state.llm.tokenizer,
                                                model_cfg.vocab_size)
        gen = build_generation(parsed, ids, param, model_cfg.max_position, cfg.default_max_tokens,
                               model_cfg.vocab_size)
        rid = f"{prefix}-{uuid.uuid4().hex}"
        choices = await _submit(state, gen, rid, param)  # (engine request id, request, queue) per choice
        reqs, queues = [r for _, r, _ in choices], [q for _, _, q in choices]
        try:
            responder = Responder(gen, rid, cfg.model_name, state.llm.tokenizer)
            if gen.stream:
                def on_close(gone: bool) -> None:
                    counters.in_flight -= 1
                    counters.disconnects += gone
                    counters.timeouts += responder.outcome == "timeout"
                    _abort(state, choices, keep_queues=True)  # the stream's own cleanup drops them
                handed_off = True
                return SSEResponse(sse_events(state.engine, reqs, queues, responder, cfg.timeout_s), on_close)
            await race_disconnect(collect_all(state.engine, reqs, queues, cfg.timeout_s), request.receive)
        except ClientGone:
            counters.disconnects += 1
            return Response(status_code=499)  # nobody reads it; 499 is nginx's "client closed request"
        except APIError as exc:
            counters.timeouts += exc.status == 408
            raise
        finally:
            if not handed_off:  # whatever went wrong, a submitted request never lingers
                _abort(state, choices)
        return JSONResponse(responder.final(reqs))
    finally:
        if not handed_off:
            counters.in_flight -= 1


async def chat_completions(request: Request) -> Response:
    return await _generate(request, ChatCompletionRequest, "chatcmpl")


async def completions(request: Request) -> Response:
    return await _generate(request, CompletionRequest, "cmpl")


async def models(request: Request) -> Response:
    state: ServerState = request.app.state.dspark
    card = {"id": state.config.model_name, "object": "model", "created": state.started, "owned_by": "dspark",
            "max_model_len": state.llm.engine.model.config.max_position}
    return JSONResponse({"object": "list", "data": [card]})


async def health(request: Request) -> Response:
    state: ServerState = request.app.state.dspark
    if not state.engine.thread.is_alive() or state.draining:
        return JSONResponse({"status": "draining" if state.draining else "engine_stopped"}, status_code=503)
    engine = state.llm.engine
    return JSONResponse({"status": "ok", "last_engine_error": None if state.engine.error is None
                         else repr(state.engine.error),
                         "drafter": None if engine.drafter is None else engine.drafter.name,
                         "policy": engine.policy.name,
                         # under a load-dependent policy a seeded sampled request repeats only under the same load
                         "load_dependent_policy": bool(getattr(engine.policy, "load_dependent", True))})


async def metrics(request: Request) -> Response:
    state: ServerState = request.app.state.dspark
    snap = await state.engine.snapshot_async()
    text = render(snap, state.counters, state.config.model_name, resident_memory_bytes())
    return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")


class Guard:
    """Pure ASGI (streams pass through untouched): Bearer key check in constant time, and response counting."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state
        key = state.config.api_key
        self.expected = None if key is None else key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        endpoint = path if path in KNOWN_PATHS else "other"

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.state.counters.responses[(endpoint, message["status"])] += 1
            await send(message)

        if self.expected is not None and path not in OPEN_PATHS:
            scheme, _, token = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
            # compare_digest: the time taken does not depend on how much of the key was right
            if not (hmac.compare_digest(token.strip(), self.expected) and scheme.lower() == b"bearer"):
                err = APIError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')", None,
                               "invalid_api_key", {"WWW-Authenticate": "Bearer"})
                return await err.response()(scope, receive, counting_send)
        return await self.app(scope, receive, counting_send)


async def _api_error(request, exc: APIError):
    return exc.response()


async def _http_error(request, exc: HTTPException):
    return APIError(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}",
                    headers=dict(exc.headers or {})).response()  # keeps 405's Allow header


async def _internal_error(request, exc: Exception):
    return APIError(500, f"internal server error: {type(exc).__name__}", None, "internal_error").response()


ROUTES = [Route("/v1/chat/completions", chat_completions, methods=["POST"]),
          Route("/v1/completions", completions, methods=["POST"]),
          Route("/v1/models", models, methods=["GET"]), Route("/health", health, methods=["GET"]),
          Route("/metrics", metrics, methods=["GET"]), Route("/tokenize", tokenize, methods=["POST"]),
          Route("/detokenize", detokenize, methods=["POST"])]
KNOWN_PATHS = {r.path for r in ROUTES}


def create_app(llm, config: ServerConfig) -> Guard:
    state = ServerState(llm, config)

    @asynccontextmanager
    async def lifespan(app):
        yield
        await asyncio.to_thread(state.begin_drain().join)
        state.tokenize_pool.shutdown(wait=False)

    app = Starlette(routes=ROUTES, lifespan=lifespan,
                    exception_handlers={APIError: _api_error, HTTPException: _http_error, Exception: _internal_error})
    app.state.dspark = state
    return Guard(app, state)
