"""The load client: one streamed or plain completion, recorded event by event, plus raw-socket
calls for faults that httpx cannot produce (RST, stalled reader, slowloris).

A `CallRecord` keeps everything the invariant checks need: every SSE event in order, how many
terminal events (finish_reason or error) and [DONE]s arrived, whether bytes followed [DONE],
the usage block, and the timing of each token event.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx


@dataclass
class CallRecord:
    tag: str  # scenario-specific group ("canary", "short", "long", "priority", ...)
    body: dict
    status: int = 0
    started_s: float = 0.0
    ttft_s: float | None = None
    latency_s: float | None = None  # request sent -> last byte
    token_times_s: list[float] = field(default_factory=list)  # monotonic stamp per text event
    text: str = ""
    finish_reasons: list[str] = field(default_factory=list)
    num_error_events: int = 0
    num_done: int = 0
    bytes_after_done: int = 0
    num_pings: int = 0
    usage: dict | None = None
    error: dict | None = None  # the error envelope of a non-2xx answer
    headers: dict = field(default_factory=dict)
    cancelled: bool = False  # the client left on purpose
    transport_error: str | None = None

    @property
    def itl_s(self) -> list[float]:
        t = self.token_times_s
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def num_terminal(self) -> int:
        return len(self.finish_reasons) + self.num_error_events


def _parse_event(rec: CallRecord, data: str, now_s: float) -> None:
    if rec.num_done:
        rec.bytes_after_done += len(data)
        return
    if data == "[DONE]":
        rec.num_done += 1
        return
    event = json.loads(data)
    if "error" in event:
        rec.num_error_events += 1
        rec.error = event["error"]
        return
    if event.get("usage"):
        rec.usage = event["usage"]
    for choice in event.get("choices", []):
        piece = choice.get("text")
        if piece is None:
            piece = (choice.get("delta") or {}).get("content")
        if piece:
            rec.text += piece
            rec.token_times_s.append(now_s)
            if rec.ttft_s is None:
                rec.ttft_s = now_s - rec.started_s
        if choice.get("finish_reason"):
            rec.finish_reasons.append(choice["finish_reason"])


async def stream_call(
    client: httpx.AsyncClient,
    body: dict,
    tag: str = "",
    cancel_after_events: int | None = None,
    path: str = "/v1/completions",
    headers: dict | None = None,
) -> CallRecord:
    """One streamed completion. `cancel_after_events`: close the connection (FIN) after that
    many text events, as a client that gives up mid-stream."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    rec = CallRecord(tag, body, started_s=time.monotonic())
    try:
        async with client.stream("POST", path, json=body, headers=headers) as r:
            rec.status, rec.headers = r.status_code, dict(r.headers)
            if r.status_code != 200:
                raw = await r.aread()
                rec.error = json.loads(raw).get("error") if raw.startswith(b"{") else None
                rec.latency_s = time.monotonic() - rec.started_s
                return rec
            async for line in r.aiter_lines():
                now_s = time.monotonic()
                if line.startswith(": ping"):
                    rec.num_pings += 1
                elif line.startswith("data: "):
                    _parse_event(rec, line[6:], now_s)
                    if (
                        cancel_after_events is not None
                        and len(rec.token_times_s) >= cancel_after_events
                    ):
                        rec.cancelled = True
                        break  # leaving the block closes the connection mid-stream
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        rec.transport_error = f"{type(exc).__name__}: {exc}"
    rec.latency_s = time.monotonic() - rec.started_s
    return rec


async def plain_call(
    client: httpx.AsyncClient,
    body: dict,
    tag: str = "",
    path: str = "/v1/completions",
    headers: dict | None = None,
) -> CallRecord:
    rec = CallRecord(tag, {**body, "stream": False}, started_s=time.monotonic())
    try:
        r = await client.post(path, json=rec.body, headers=headers)
        rec.status, rec.headers = r.status_code, dict(r.headers)
        data = r.json()
        if r.status_code == 200:
            choice = data["choices"][0]
            rec.text = choice.get("text") or (choice.get("message") or {}).get("content") or ""
            rec.finish_reasons = [c["finish_reason"] for c in data["choices"]]
            rec.usage = data.get("usage")
            rec.num_done = 1  # a JSON body is its own end
        else:
            rec.error = data.get("error")
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        rec.transport_error = f"{type(exc).__name__}: {exc}"
    rec.latency_s = time.monotonic() - rec.started_s
    return rec


# ---- raw sockets ----------------------------------------------------------------------------


def http_request_bytes(url: str, body: dict | bytes, path: str = "/v1/completions") -> bytes:
    host = urlsplit(url).netloc
    payload = body if isinstance(body, bytes) else json.dumps(body).encode()
    return (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
    ).encode() + payload


async def open_raw(
    url: str, rcvbuf_bytes: int | None = None
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    parts = urlsplit(url)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf_bytes:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf_bytes)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (parts.hostname, parts.port))
    return await asyncio.open_connection(sock=sock, limit=1 << 16)


def close_with_rst(writer: asyncio.StreamWriter) -> None:
    """SO_LINGER 0 then close: the kernel sends RST instead of FIN."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def raw_call_then_leave(
    url: str, body: dict, read_bytes: int, rst: bool, timeout_s: float = 30.0
) -> int:
    """Send a call, read at least `read_bytes` of the answer (0: leave before any answer),
    then close with FIN or RST. Returns the bytes read."""
    reader, writer = await open_raw(url)
    writer.write(http_request_bytes(url, body))
    await writer.drain()
    got = 0
    deadline = time.monotonic() + timeout_s
    while got < read_bytes and time.monotonic() < deadline:
        chunk = await asyncio.wait_for(reader.read(4096), timeout=timeout_s)
        if not chunk:
            break
        got += len(chunk)
    if rst:
        close_with_rst(writer)
    else:
        writer.close()
    return got


def parse_raw_sse(raw: bytes, tag: str, body: dict) -> CallRecord:
    """A CallRecord from a raw HTTP/1.1 answer (chunked SSE), for slow-reader checks."""
    rec = CallRecord(tag, body)
    head, _, rest = raw.partition(b"\r\n\r\n")
    rec.status = int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/") else 0
    text = (
        _dechunk(rest).decode("utf-8", "replace")
        if b"chunked" in head.lower()
        else rest.decode("utf-8", "replace")
    )
    for line in text.split("\n"):
        if line.startswith("data: "):
            _parse_event(rec, line[6:].strip(), 0.0)
    return rec


def _dechunk(data: bytes) -> bytes:
    out, i = [], 0
    while i < len(data):
        j = data.find(b"\r\n", i)
        if j < 0:
            break
        size = int(data[i:j].split(b";")[0] or b"0", 16)
        if size == 0:
            break
        out.append(data[j + 2 : j + 2 + size])
        i = j + 2 + size + 2
    return b"".join(out)


async def metric_total(client: httpx.AsyncClient, name: str) -> float:
    """The sum over all label sets of one counter on the server's /metrics (`name` without the
    `_total` suffix, as prometheus_client names the family)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = (await client.get("/metrics")).text
    for family in text_string_to_metric_families(text):
        if family.name == name:
            return sum(s.value for s in family.samples if s.name == name + "_total")
    raise AssertionError(f"/metrics has no {name}_total")
