"""The connection layer alone (no model): the head cap counts a head however it arrives, and a
response sent before the body was read closes the connection after a bounded linger, so the
client reads it and a client that keeps sending is cut (server/http_timeouts.py,
server/unread_body.py; the same on the real server: e2e/test_hostile_input.py)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from ultrafast.server.http_timeouts import protocol_class
from ultrafast.server.unread_body import CloseOnUnreadBody


async def _refuse_bodies(scope, receive, send):
    """413 for any request with a body, without reading it; 200 otherwise."""
    if scope["type"] != "http":
        return
    has_body = any(k == b"content-length" and v != b"0" for k, v in scope["headers"])
    status, body = (413, b'{"error":"too large"}') if has_body else (200, b"ok")
    headers = [(b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture(scope="module")
def port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(
            CloseOnUnreadBody(_refuse_bodies),
            host="127.0.0.1",
            port=free,
            http=protocol_class(),
            lifespan="off",
            log_level="error",
        )
    )
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield free
    server.should_exit = True
    thread.join(10)


def _send_all_then_read(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        try:
            s.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except ConnectionResetError:
            pass
        return out


@pytest.mark.parametrize("kib", [17, 40])
def test_a_long_head_in_one_write_is_refused(port, kib):
    head = b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (kib << 10) + b"\r\n\r\n"
    answer = _send_all_then_read(port, head)
    assert answer.startswith(b"HTTP/1.1 431") and b"connection: close" in answer.lower()


def test_a_head_within_the_cap_and_its_keep_alive_are_untouched(port):
    head = b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (8 << 10) + b"\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        for _ in range(2):  # two requests on one connection: both served
            s.sendall(head)
            answer = b""
            while not answer.endswith(b"ok"):
                answer += s.recv(65536)
            assert answer.startswith(b"HTTP/1.1 200")


def test_an_early_response_is_readable_by_a_client_that_writes_its_body_first(port):
    r = httpx.post(f"http://127.0.0.1:{port}/", content=b"x" * (8 << 20), timeout=30)
    assert r.status_code == 413 and r.headers["connection"] == "close"


def _whole_response(s: socket.socket) -> bytes:
    """One response read to the end of its Content-Length body."""
    answer = b""
    while b"\r\n\r\n" not in answer:
        answer += s.recv(65536)
    head, body = answer.split(b"\r\n\r\n", 1)
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        body += s.recv(65536)
    return head + b"\r\n\r\n" + body


def test_a_client_that_keeps_sending_is_cut(port):
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000\r\n\r\n")
        answer = _whole_response(s)  # head and body may come in separate segments
        assert answer.startswith(b"HTTP/1.1 413") and b"connection: close" in answer.lower()
        s.settimeout(0.5)
        assert s.recv(65536) == b""  # FIN: nothing more will come from the server
        # keep sending: the server shuts its side at once (FIN), drops what still comes and
        # closes within its linger, when sending fails (a bound against a hang, not a timing)
        closed, deadline = False, time.monotonic() + 60
        while not closed and time.monotonic() < deadline:
            try:
                s.sendall(b"x" * 65536)
                time.sleep(0.01)
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                closed = True
        assert closed
