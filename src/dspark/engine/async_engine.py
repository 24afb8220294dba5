"""An asyncio front for the engine: the engine steps in one background thread; each request streams its
outputs through an asyncio queue. The engine is not thread-safe, so every touch of it holds `lock`.
"""
from __future__ import annotations

import asyncio
import threading
import time
from typing import AsyncIterator

from ..decoding import SamplingParams
from .engine import Engine
from .request import Request, RequestOutput


class EngineStopped(RuntimeError):
    pass


class AsyncEngine:
    def __init__(self, engine: Engine):
        self.engine = engine
        self.lock = threading.Lock()
        self.wake = threading.Condition(self.lock)
        self.queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.accepting = True
        self._stop = False
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._loop, name="dspark-engine", daemon=True)
        self.thread.start()

    # ---------------------------------------------------------------- engine thread
    def _loop(self) -> None:
        while True:
            with self.wake:
                while not self._stop and not self.engine.has_unfinished():
                    self.wake.wait()
                if self._stop:
                    return
                try:
                    outputs = self.engine.step()
                except BaseException as exc:  # engine bug: fail everyone loudly rather than hang them
                    self.error = exc
                    outputs = [RequestOutput(r.request_id, [], "", True, "error", r)
                               for r in [*self.engine.running, *self.engine.waiting]]
                    for r in [*self.engine.running, *self.engine.waiting]:
                        r.finish("error", f"engine failure: {exc}")
                    self.engine.running.clear()
                    self.engine.waiting.clear()
            self._dispatch(outputs)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            target = self.queues.get(out.request_id)
            if target is not None:
                loop, queue = target
                loop.call_soon_threadsafe(queue.put_nowait, out)

    # ---------------------------------------------------------------- API
    def submit(self, prompt: list[int], params: SamplingParams, stop_strings=(), request_id: str | None = None
               ) -> tuple[Request, asyncio.Queue]:
        """Add a request (raises RequestRejected / SamplingError at once) and return its output queue."""
        if not self.accepting:
            raise EngineStopped("the server is shutting down")
        queue: asyncio.Queue = asyncio.Queue()
        with self.wake:
            req = self.engine.add_request(prompt, params, stop_strings, request_id)
            self.queues[req.request_id] = (asyncio.get_running_loop(), queue)
            self.wake.notify()
        return req, queue

    async def stream(self, req: Request, queue: asyncio.Queue, timeout: float | None = None
                     ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs until it finishes; abort it if the consumer goes away or times out."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    out = await asyncio.wait_for(queue.get(), remaining)
                except asyncio.TimeoutError:
                    self.abort(req.request_id)
                    req.finish_reason = req.finish_reason or "timeout"
                    raise
                yield out
                if out.finished:
                    return
        finally:
            if not req.finished:
                self.abort(req.request_id)
            self.queues.pop(req.request_id, None)

    def abort(self, request_id: str) -> None:
        with self.wake:
            self.engine.abort(request_id)
            self.wake.notify()

    def reset_prefix_cache(self) -> int:
        """Engine.reset_prefix_cache under the lock: the finished requests kept as prefix donors go."""
        with self.lock:
            return self.engine.reset_prefix_cache()

    def snapshot(self) -> dict:
        """A consistent view of the counters for /metrics."""
        with self.lock:
            s = self.engine.stats
            return {"stats": s, "waiting": len(self.engine.waiting), "running": len(self.engine.running),
                    "kv_reserved": self.engine.kv_reserved, "kv_cached": self.engine.kv_cached,
                    "kv_budget": self.engine.kv_budget}

    def shutdown(self, deadline_s: float = 10.0) -> None:
        """Stop accepting, let in-flight work finish until the deadline, then abort the rest and stop."""
        self.accepting = False
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            with self.lock:
                if not self.engine.has_unfinished():
                    break
            time.sleep(0.05)
        with self.wake:
            for req in [*self.engine.waiting, *self.engine.running]:
                self.engine.abort(req.request_id)
            self._dispatch(self.engine.step())  # reaps the aborted requests, frees their KV, tells their streams
            self._stop = True
            self.wake.notify()
        self.thread.join(timeout=5)
