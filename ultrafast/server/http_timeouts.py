"""Connection-level defences uvicorn lacks: request head and body timeouts (slowloris, a slow
body), a write-stall timeout and a cap on open connections per client IP.

`TimedH11Protocol` is uvicorn's h11 protocol plus two timers, per connection:

- head timer: armed when the connection opens and again after each response; it is cancelled
  as soon as h11 has parsed a whole request head. If it fires first (a client dribbling its
  headers, or a connection opened and never used), the server answers 408 when some bytes had
  arrived and closes the connection. Keep-alive is untouched: a next request that arrives in
  time is served on the same connection.
- body timer: armed once the head is parsed while the body is still coming, cancelled when
  the body is complete. If it fires first, the server answers 408 `request_timeout` (OpenAI
  envelope), tells the app its client is gone (so its read ends) and closes the connection.
- write-stall timer: armed when the transport's write buffer passes its high-water mark
  (the kernel buffers are full, the client is not reading) and cancelled when it drains.
  If the client has read nothing for the whole timeout, the connection is aborted; uvicorn
  then reports a disconnect to the app, which ends the stream and frees its KV slot in a step.

- send buffer: each connection's kernel send buffer is set to `send_buffer_bytes` (256 KiB; the
  kernel doubles it), instead of Linux's autotuning up to tcp_wmem's maximum (4 MiB here). A
  client that reads nothing then holds well under 1 MiB of the server's memory, and its
  stall is seen (and cut) after that much, not after 4 MiB of a stream that may end first.
- per-IP cap: a connection beyond `max_connections_per_ip` open ones from the same address
  gets 429 `too_many_connections` + Retry-After and is closed before anything is parsed.
- head cap: a request head longer than `max_head_bytes` (16 KiB) gets 431 and the connection
  closes, however the head arrives. h11's own limit only counts a head still incomplete in
  its buffer, so a 20-64 KiB head sent in one write used to be served.
- closing while the client still sends (a 413 or 431 answered before the body or the rest of
  the head was read; server/unread_body.py makes such a response `Connection: close`): the
  response is flushed and the write side shut (FIN), what the client still sends is dropped
  unparsed, and the socket closes when the client closes or after `linger_s` (2 s), whichever
  is first. Closing at once would make the kernel answer the client's next bytes with a
  reset, which discards the response it was sent (httpx then reports a ReadError, not the
  413); never closing let a client that keeps sending hold the connection indefinitely.

`protocol_class(...)` gives the class to pass as
`uvicorn.Config(http=...)`.
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("ultrafast")

RESPONSE_408 = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"content-length: 25\r\nconnection: close\r\n\r\nrequest header timed out\n"
)


def _too_many_connections(cap: int) -> bytes:
    body = (
        b'{"error":{"message":"more than %d open connections from this address","type":'
        b'"rate_limit_error","param":null,"code":"too_many_connections"}}' % cap
    )
    return (
        b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\n"
        b"retry-after: 1\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(body)
    ) + body


_HEAD_END = re.compile(rb"\n\r?\n")  # h11 ends a head at a blank line, CRLF or bare LF


def _head_431(cap: int) -> bytes:
    body = (
        b'{"error":{"message":"the request head is larger than %d bytes","type":'
        b'"invalid_request_error","param":null,"code":"request_header_too_large"}}' % cap
    )
    return (
        b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body)
    ) + body


def _body_408(timeout_s: float) -> bytes:
    body = (
        b'{"error":{"message":"the request body did not arrive within %s s","type":'
        b'"invalid_request_error","param":null,"code":"request_timeout"}}'
        % f"{timeout_s:g}".encode()
    )
    return (
        b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body)
    ) + body


class TimedH11Protocol(H11Protocol):
    header_timeout_s: float = 10.0  # 0 = no head timer
    write_stall_timeout_s: float = 30.0  # 0 = no write-stall timer
    body_timeout_s: float = 30.0  # 0 = no body timer
    max_connections_per_ip: int = 0  # 0 = no cap
    max_head_bytes: int = 16 * 1024  # request line + headers; 0 = h11's own limit only
    linger_s: float = 2.0  # a closing connection drops what the client still sends this long
    send_buffer_bytes: int = 256 * 1024  # SO_SNDBUF per connection; 0 = the kernel's autotuning
    open_by_ip: dict[str, int]  # per server (protocol_class gives each its own dict)

    # asyncio.Protocol takes a BaseTransport; uvicorn's H11Protocol narrows it, with this ignore
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._socket_transport = transport
        self._linger_timer: asyncio.TimerHandle | None = None
        # what uvicorn (and its request cycles) close: a half-close while input may still come
        self.transport = _LingeringTransport(transport, self)  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if self.send_buffer_bytes > 0 and sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.send_buffer_bytes)
        self._head_timer: asyncio.TimerHandle | None = None
        self._stall_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._head_bytes = 0  # bytes of the current, still incomplete request head
        self._head_buf = bytearray()  # the same bytes, while no blank line ended them
        self._ip = self.client[0] if self.client else None
        if self.max_connections_per_ip > 0 and self._ip is not None:
            if self.open_by_ip.get(self._ip, 0) >= self.max_connections_per_ip:
                self._ip = None  # not counted: refused
                self.transport.write(_too_many_connections(self.max_connections_per_ip))
                self.transport.close()
                return
            self.open_by_ip[self._ip] = self.open_by_ip.get(self._ip, 0) + 1
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        _cancel(self._linger_timer)
        self._cancel_head_timer()
        self._cancel_stall_timer()
        self._cancel_body_timer()
        if self.max_connections_per_ip > 0 and self._ip is not None:
            left = self.open_by_ip.get(self._ip, 1) - 1
            if left > 0:
                self.open_by_ip[self._ip] = left
            else:
                self.open_by_ip.pop(self._ip, None)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._linger_timer is not None:
            return  # closing: what the client still sends is dropped unread
        if self._head_timer is not None:
            self._head_bytes += len(data)
        if self.conn.their_state is h11.IDLE and self._head_too_long(data):
            return
        super().data_received(data)
        if self._head_timer is not None and self.conn.their_state is not h11.IDLE:
            self._cancel_head_timer()  # the whole head is parsed: the app has the request
        self._track_body()

    def _head_too_long(self, data: bytes) -> bool:
        """True, after answering 431 and closing, when the head being received passes
        `max_head_bytes` (the head's end is looked for in what came so far)."""
        if self.max_head_bytes <= 0 or self.transport.is_closing():
            return False
        buf = self._head_buf
        start = max(0, len(buf) - 2)  # a blank line may straddle two reads
        buf += data
        end = _HEAD_END.search(buf, start)
        size = len(buf) if end is None else end.end()
        if size <= self.max_head_bytes:
            if end is not None:
                buf.clear()  # this head is complete: h11 parses it; what follows is its body
            return False
        log.warning(
            "closing a connection from %s: request head over %d bytes",
            self.client,
            self.max_head_bytes,
        )
        buf.clear()
        self._cancel_head_timer()
        self.transport.write(_head_431(self.max_head_bytes))
        self.linger_close()  # the rest of the head may still be coming
        return True

    # ---- closing while the client may still send -------------------------------------------

    @property
    def lingering(self) -> bool:
        return self._linger_timer is not None

    def input_pending(self) -> bool:
        """True while the client may still be sending this request (its body is unread)."""
        return self.conn.their_state is h11.SEND_BODY

    def linger_close(self) -> None:
        """Flush, shut the write side, drop further input; close at the client's EOF or after
        `linger_s`."""
        transport = self._socket_transport
        if self._linger_timer is not None or transport.is_closing():
            return
        if self.linger_s <= 0 or not transport.can_write_eof():
            transport.close()
            return
        self._cancel_head_timer()
        self._cancel_body_timer()
        transport.write_eof()  # FIN once the response is written
        transport.resume_reading()  # flow control may have paused it: read (and drop) on
        self._linger_timer = self.loop.call_later(self.linger_s, transport.close)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm_head_timer()  # the next request on this keep-alive connection

    # ---- request-head timeout ---------------------------------------------------------------

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_bytes = 0
        self._head_buf.clear()
        if self.header_timeout_s > 0:
            self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        _cancel(self._head_timer)
        self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self._head_bytes:  # a started head: say why (an unused connection just closes)
            log.warning(
                "closing a connection from %s: request head incomplete after %.1f s",
                self.client,
                self.header_timeout_s,
            )
            self.transport.write(RESPONSE_408)
        self.transport.close()

    # ---- request-body timeout ---------------------------------------------------------------

    def _track_body(self) -> None:
        cycle = self.cycle
        coming = (
            cycle is not None
            and cycle.more_body
            and not cycle.response_started
            and self.conn.their_state is h11.SEND_BODY
        )
        if not coming:
            self._cancel_body_timer()
        elif self._body_timer is None and self.body_timeout_s > 0:
            self._body_timer = self.loop.call_later(self.body_timeout_s, self._body_timed_out)

    def _cancel_body_timer(self) -> None:
        _cancel(self._body_timer)
        self._body_timer = None

    def _body_timed_out(self) -> None:
        self._body_timer = None
        cycle = self.cycle
        if (
            self.transport.is_closing()
            or cycle is None
            or not cycle.more_body
            or cycle.response_started
        ):
            return
        log.warning(
            "closing a connection from %s: request body incomplete %.1f s after its head",
            self.client,
            self.body_timeout_s,
        )
        self.transport.write(_body_408(self.body_timeout_s))
        cycle.disconnected = True  # the app's body read ends; its own answer goes nowhere
        cycle.message_event.set()
        self.transport.close()

    # ---- write stall ------------------------------------------------------------------------

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall_timer is None and self.write_stall_timeout_s > 0:
            self._stall_timer = self.loop.call_later(
                self.write_stall_timeout_s, self._write_stalled
            )

    def resume_writing(self) -> None:
        self._cancel_stall_timer()
        super().resume_writing()

    def _cancel_stall_timer(self) -> None:
        _cancel(self._stall_timer)
        self._stall_timer = None

    def _write_stalled(self) -> None:
        self._stall_timer = None
        # also when the response is complete and the transport is only closing: close() waits
        # for the buffer to drain, which a client that reads nothing never lets happen
        log.warning(
            "aborting a connection from %s: the client read nothing for %.1f s",
            self.client,
            self.write_stall_timeout_s,
        )
        self.transport.abort()  # close() would wait for the full buffer to drain: never


class _LingeringTransport:
    """The connection's transport as uvicorn sees it; `close()` lingers (linger_close) while
    the request's body is unread, else closes."""

    def __init__(self, transport: asyncio.Transport, protocol: TimedH11Protocol):
        self._transport = transport
        self._protocol = protocol

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def is_closing(self) -> bool:
        return self._transport.is_closing() or self._protocol.lingering

    def close(self) -> None:
        if self._protocol.input_pending():
            self._protocol.linger_close()
        else:
            self._transport.close()


def _cancel(timer: asyncio.TimerHandle | None) -> None:
    if timer is not None:
        timer.cancel()


def protocol_class(
    header_timeout_s: float = 10.0,
    write_stall_timeout_s: float = 30.0,
    body_timeout_s: float = 30.0,
    max_connections_per_ip: int = 0,
    send_buffer_bytes: int = 256 * 1024,
) -> type:
    """A TimedH11Protocol subclass carrying these limits (uvicorn builds one per connection)."""
    return type(
        "ServerH11Protocol",
        (TimedH11Protocol,),
        {
            "header_timeout_s": header_timeout_s,
            "write_stall_timeout_s": write_stall_timeout_s,
            "body_timeout_s": body_timeout_s,
            "max_connections_per_ip": max_connections_per_ip,
            "send_buffer_bytes": send_buffer_bytes,
            "open_by_ip": {},
        },
    )
