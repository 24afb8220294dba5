"""The engine as the event loop sees it.

AsyncEngine's engine thread holds its lock for a whole step (tens of milliseconds for a tiny model, seconds for
SmolLM2 at batch 48). Its `submit`, `abort` and `snapshot` take that lock on the caller's thread, which here is
the event loop: every new request or disconnect would freeze every other stream for up to a step. This subclass
makes those waits on a small worker pool instead and keeps the loop free. The server also counts the requests
it has in flight, which is what admission (`--max-concurrency` + `--max-queue`) is decided on.
"""
from __future__ import annotations

import asyncio
import copy
import os
from concurrent.futures import ThreadPoolExecutor

from ..engine.async_engine import AsyncEngine, EngineStopped
from ..engine.engine import Engine
from ..engine.request import Request


class ServingEngine(AsyncEngine):
    def __init__(self, engine: Engine):
        super().__init__(engine)
        self.pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="dspark-intake")

    async def submit_async(self, prompt: list[int], params, stop_strings=(), request_id: str | None = None
                           ) -> tuple[Request, asyncio.Queue]:
        """As `submit`, without blocking the loop. Raises RequestRejected / EngineStopped like it."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        future = loop.run_in_executor(self.pool, self._add, loop, queue, prompt, params, stop_strings, request_id)
        try:
            return await asyncio.shield(future), queue
        except asyncio.CancelledError:
            # The client left while we waited for the lock; the request may still get added afterwards, and
            # nobody would ever read it, so abort it the moment it exists.
            future.add_done_callback(self._abort_orphan)
            raise

    def _add(self, loop, queue, prompt, params, stop_strings, request_id) -> Request:
        if not self.accepting:
            raise EngineStopped("the server is shutting down")
        with self.wake:
            req = self.engine.add_request(prompt, params, stop_strings, request_id)
            self.queues[req.request_id] = (loop, queue)  # registered before the engine can step it
            self.wake.notify()
        return req

    def _abort_orphan(self, future) -> None:
        if not future.cancelled() and future.exception() is None:
            req = future.result()
            self.queues.pop(req.request_id, None)
            self.abort(req.request_id)

    def abort(self, request_id: str) -> None:
        """Non-blocking: the abort lands at the end of the current step, and the next step frees the KV."""
        try:
            self.pool.submit(AsyncEngine.abort, self, request_id)
        except RuntimeError:  # pool already shut down: we are past shutdown, the engine has stopped
            pass

    async def snapshot_async(self) -> dict:
        return await asyncio.get_running_loop().run_in_executor(self.pool, self._copy_snapshot)

    def _copy_snapshot(self) -> dict:
        # Copied under the lock, so one scrape never mixes counters from two different steps.
        with self.lock:
            e = self.engine
            return {"stats": copy.deepcopy(e.stats), "waiting": len(e.waiting), "running": len(e.running),
                    "kv_reserved": e.kv_reserved, "kv_cached": e.kv_cached, "kv_budget": e.kv_budget,
                    "alive": self.thread.is_alive(),
                    "error": None if self.error is None else repr(self.error)}

    def close(self, deadline_s: float) -> None:
        """Graceful stop (blocking): finish in-flight work until the deadline, abort the rest, stop the thread."""
        self.shutdown(deadline_s)
        self.pool.shutdown(wait=True)


def resident_memory_bytes() -> int:
    """Process RSS from /proc (Linux); 0 elsewhere. For the load test's memory-growth check and /metrics."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
