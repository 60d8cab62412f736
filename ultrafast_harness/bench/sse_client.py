"""A minimal streaming client for benchmarks: one HTTP/1.1 POST, chunked body, SSE events.

httpx's line iterator costs tens of microseconds of Python per event; on a 2-core machine
that runs beside the server and competes with it, so a client-side cost shows up as "server
overhead". This client does the least a real consumer must (de-chunk, split events, parse each
event's JSON) so the benchmark measures the server's streaming path, not the client library.
"""

from __future__ import annotations

import asyncio
import time

import orjson


class StreamError(RuntimeError):
    pass


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            name, value = line.split(":", 1)
            headers[name.strip().lower()] = value.strip()
    return status, headers


async def _chunks(reader: asyncio.StreamReader):
    """Yield the pieces of a chunked transfer-encoded body as they arrive."""
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        if size == 0:
            await reader.readuntil(b"\r\n")
            return
        data = await reader.readexactly(size + 2)
        yield data[:-2]


async def stream_events(host: str, port: int, path: str, body: dict):
    """POST `body` and yield (arrival perf_counter, parsed JSON) for every SSE data event."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        payload = orjson.dumps(body)
        writer.write(
            b"POST %s HTTP/1.1\r\nhost: %s:%d\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n"
            % (path.encode(), host.encode(), port, len(payload))
            + payload
        )
        await writer.drain()
        status, headers = await _read_head(reader)
        if status != 200:
            raise StreamError(f"HTTP {status}")
        if headers.get("transfer-encoding", "").lower() != "chunked":
            raise StreamError("expected a chunked event stream")
        buffer = b""
        async for piece in _chunks(reader):
            now = time.perf_counter()
            buffer += piece
            *events, buffer = buffer.split(b"\n\n")
            for event in events:
                if not event.startswith(b"data: "):
                    continue  # keep-alive comment
                data = event[6:]
                if data == b"[DONE]":
                    return
                yield now, orjson.loads(data)
    finally:
        writer.close()


async def completion_token_stamps(host: str, port: int, body: dict) -> tuple[float, list[float]]:
    """(request start, arrival time of each text delta) of one streamed /v1/completions call."""
    start = time.perf_counter()
    stamps = []
    async for now, event in stream_events(host, port, "/v1/completions", body):
        if "error" in event:
            raise StreamError(event["error"]["message"])
        if any(c.get("text") for c in event.get("choices", [])):
            stamps.append(now)
    return start, stamps
