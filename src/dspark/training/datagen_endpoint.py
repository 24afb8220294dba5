"""Answer regeneration through any OpenAI-compatible server (vLLM, SGLang, our own `dspark serve`).

Conversations run in parallel threads; the turns of one conversation run in order, each new user turn sent
with the answers regenerated so far. A conversation that still fails after retries is not written, so the
next run (resume) tries it again.
"""
from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Callable

from .conversations import PromptRecord

RETRIES = 3


def chat_url(endpoint: str) -> str:
    base = endpoint.rstrip("/")
    if base.endswith("/chat/completions"):
        return base
    return base + ("/chat/completions" if base.endswith("/v1") else "/v1/chat/completions")


def _post(url: str, payload: dict, timeout: float) -> dict:
    request = urllib.request.Request(url, data=json.dumps(payload).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def _complete(url: str, payload: dict, timeout: float) -> dict:
    delay = 1.0
    for attempt in range(RETRIES):
        try:
            return _post(url, payload, timeout)
        except (urllib.error.URLError, TimeoutError, ConnectionError, json.JSONDecodeError) as exc:
            if attempt == RETRIES - 1:
                raise
            print(f"datagen: {url}: {exc}; retrying in {delay:.0f}s", file=sys.stderr)
            time.sleep(delay)
            delay *= 2
    raise AssertionError("unreachable")


def _conversation(url: str, model: str, record: PromptRecord, settings, timeout: float) -> dict:
    from .datagen import record_seed

    messages = record.first_messages()
    answer_tokens, reasons = [], []
    for turn, text in enumerate(record.turns):
        if turn:
            messages.append({"role": "user", "content": text})
        payload = {"model": model, "messages": messages, "temperature": settings.temperature,
                   "top_p": settings.top_p, "max_tokens": settings.max_new_tokens,
                   "seed": record_seed(settings.seed, record.id) + turn, "stream": False}
        if settings.top_k:
            payload["top_k"] = settings.top_k  # an extension vLLM and SGLang accept
        reply = _complete(url, payload, timeout)
        choice = reply["choices"][0]
        messages.append({"role": "assistant", "content": choice["message"]["content"] or ""})
        answer_tokens.append(int((reply.get("usage") or {}).get("completion_tokens", 0)))
        reasons.append(choice.get("finish_reason") or "stop")
    return {"id": record.id, "line": record.line, "source": record.source, "status": "ok", "messages": messages,
            "answer_tokens": answer_tokens, "finish_reasons": reasons}


def generate_endpoint(endpoint: str, model: str, records: list[PromptRecord], settings,
                      emit: Callable[[dict], None], timeout: float = 600.0) -> int:
    """-> the number of conversations that failed (they are not written)."""
    url, failed = chat_url(endpoint), 0
    pool = ThreadPoolExecutor(max_workers=max(1, settings.concurrency))
    try:
        futures = {pool.submit(_conversation, url, model, r, settings, timeout): r for r in records}
        for future in as_completed(futures):
            record = futures[future]
            try:
                result = future.result()
            except Exception as exc:  # one bad reply must not stop the whole run
                failed += 1
                print(f"datagen: {record.id} (line {record.line}) failed: {type(exc).__name__}: {exc}",
                      file=sys.stderr)
                continue
            emit(result)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # on interruption, queued conversations never start
    return failed
