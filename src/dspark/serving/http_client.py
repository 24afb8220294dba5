"""A minimal asyncio HTTP/1.1 client for the load test: it must send what real clients never would (broken
UTF-8, lying Content-Length) and hang up mid-stream on purpose, which high-level clients make awkward."""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import AsyncIterator
from urllib.parse import urlsplit


@dataclass
class Reply:
    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""

    def json(self):
        return json.loads(self.body)


class Connection:
    """One request on one connection (Connection: close), so a hang-up is just closing the socket."""

    def __init__(self, base_url: str, api_key: str | None = None):
        url = urlsplit(base_url)
        self.host, self.port = url.hostname or "127.0.0.1", url.port or 80
        self.api_key = api_key
        self.writer: asyncio.StreamWriter | None = None

    async def send(self, method: str, path: str, body: bytes | None = None,
                   headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], asyncio.StreamReader]:
        reader, self.writer = await asyncio.open_connection(self.host, self.port)
        head = {"Host": f"{self.host}:{self.port}", "Connection": "close", "Accept": "*/*"}
        if body is not None:
            head.update({"Content-Type": "application/json", "Content-Length": str(len(body))})
        if self.api_key:
            head["Authorization"] = f"Bearer {self.api_key}"
        head.update(headers or {})
        lines = [f"{method} {path} HTTP/1.1", *(f"{k}: {v}" for k, v in head.items()), "", ""]
        self.writer.write("\r\n".join(lines).encode("latin-1") + (body or b""))
        await self.writer.drain()
        status_line = await reader.readline()
        if not status_line:
            raise ConnectionError("the server closed the connection without answering")
        status = int(status_line.split()[1])
        headers_in = {}
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            key, _, value = line.decode("latin-1").partition(":")
            headers_in[key.strip().lower()] = value.strip()
        return status, headers_in, reader

    async def chunks(self, headers: dict[str, str], reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
        if headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    await reader.readline()
                    return
                data = await reader.readexactly(size)
                await reader.readexactly(2)
                yield data
        elif "content-length" in headers:
            yield await reader.readexactly(int(headers["content-length"]))
        else:
            yield await reader.read()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


async def request(base_url: str, method: str, path: str, body: bytes | None = None, api_key: str | None = None,
                  headers: dict[str, str] | None = None, timeout: float = 120.0) -> Reply:
    conn = Connection(base_url, api_key)
    try:
        async with asyncio.timeout(timeout):
            status, head, reader = await conn.send(method, path, body, headers)
            data = b"".join([c async for c in conn.chunks(head, reader)])
            return Reply(status, head, data)
    finally:
        conn.close()


async def sse_stream(conn: Connection, path: str, payload: dict) -> AsyncIterator[tuple[int, object]]:
    """Yield (status, event): the parsed JSON of each `data:` event, or the string "[DONE]". A non-200 answer
    yields once with its JSON error body. Breaking out of the loop and calling conn.close() hangs up."""
    status, head, reader = await conn.send("POST", path, json.dumps(payload).encode())
    if status != 200:
        body = b"".join([c async for c in conn.chunks(head, reader)])
        yield status, json.loads(body or b"null")
        return
    buffer = b""
    async for chunk in conn.chunks(head, reader):
        buffer += chunk
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            data = event.removeprefix(b"data: ")
            yield status, "[DONE]" if data == b"[DONE]" else json.loads(data)
