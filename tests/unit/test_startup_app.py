"""Ready in seconds (server/startup.py): the port is bound before the model loads (a taken
port is an error at once), and while the model loads every request gets a clear 503 instead
of a refused connection; then the real app, its lifespan started, answers everything."""

import asyncio
import contextlib
import json
import socket

import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from ultrafast.server.startup import LoadingApp, bind_listen_socket


async def _call(app, path: str, method: str = "GET") -> tuple[int, dict, dict]:
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "headers": [],
        "scheme": "http",
        "server": ("127.0.0.1", 1),
        "client": ("127.0.0.1", 2),
        "root_path": "",
        "http_version": "1.1",
        "asgi": {"version": "3.0"},
    }
    await app(scope, receive, send)
    start = sent[0]
    body = b"".join(m.get("body", b"") for m in sent[1:])
    headers = {k.decode(): v.decode() for k, v in start["headers"]}
    return start["status"], headers, json.loads(body)


def test_while_loading_health_and_ready_say_loading_and_calls_get_an_openai_error():
    async def run():
        app = LoadingApp()
        status, _, body = await _call(app, "/health")
        assert (status, body) == (503, {"status": "loading"})
        status, _, body = await _call(app, "/ready")
        assert (status, body) == (503, {"status": "loading"})
        status, headers, body = await _call(app, "/v1/chat/completions", "POST")
        assert status == 503 and headers["retry-after"] == "1"
        assert body["error"]["code"] == "model_loading" and body["error"]["message"]

    asyncio.run(run())


def test_activation_starts_the_real_apps_lifespan_and_hands_every_request_over():
    events = []

    @contextlib.asynccontextmanager
    async def lifespan(app):
        events.append("startup")
        yield
        events.append("shutdown")

    async def health(request):
        return JSONResponse({"status": "ok"})

    real = Starlette(routes=[Route("/health", health)], lifespan=lifespan)

    async def run():
        app = LoadingApp()
        outer_in: asyncio.Queue = asyncio.Queue()
        outer_out: asyncio.Queue = asyncio.Queue()
        outer = asyncio.create_task(app({"type": "lifespan"}, outer_in.get, outer_out.put))
        await outer_in.put({"type": "lifespan.startup"})
        assert (await outer_out.get())["type"] == "lifespan.startup.complete"
        await app.activate(real)
        assert events == ["startup"]
        status, _, body = await _call(app, "/health")
        assert (status, body) == (200, {"status": "ok"})
        await outer_in.put({"type": "lifespan.shutdown"})
        assert (await outer_out.get())["type"] == "lifespan.shutdown.complete"
        await outer
        assert events == ["startup", "shutdown"]

    asyncio.run(run())


def test_a_taken_port_is_reported_at_once_naming_the_flag():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=f"127.0.0.1:{port}.*--port"):
            bind_listen_socket("127.0.0.1", port)
    sock = bind_listen_socket("127.0.0.1", 0)
    try:  # listening already: a client may connect before the server loop runs
        with socket.create_connection(sock.getsockname()[:2], timeout=2):
            pass
    finally:
        sock.close()
