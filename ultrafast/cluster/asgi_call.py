"""One HTTP call into an ASGI app in this process, its answer as an async generator: the
replica side of the ingress's `forward` (replica.py), and the tests' in-process replicas.

The request is a plain dict (it crosses Ray as such): method, path, query_string, headers
[(bytes, bytes)], body, client. The generator yields {"status", "headers"} then body chunks.
Closing it early (the client left, the ingress gave up) tells the app the client disconnected,
so a stream frees its KV slot as it does behind uvicorn.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any


async def call_asgi(app, request: dict) -> AsyncIterator[Any]:
    queue: asyncio.Queue = asyncio.Queue()
    disconnected = asyncio.Event()
    body_sent = False

    async def receive() -> dict:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": request.get("body", b""), "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await queue.put(message)

    scope = {**base_scope(request, "http"), "method": request["method"]}
    task = asyncio.get_running_loop().create_task(app(scope, receive, send))
    task.add_done_callback(lambda _: queue.put_nowait(None))
    try:
        while True:
            message = await queue.get()
            if message is None:  # the app returned (or raised) without finishing its answer
                if not task.cancelled() and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
                return
            if message["type"] == "http.response.start":
                headers = [
                    (k.decode("latin-1"), v.decode("latin-1")) for k, v in message["headers"]
                ]
                yield {"status": message["status"], "headers": headers}
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    return
    finally:
        disconnected.set()
        if not task.done():
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, Exception):
                await asyncio.wait_for(asyncio.shield(task), 2.0)
            if not task.done():
                task.cancel()


def base_scope(request: dict, kind: str) -> dict[str, Any]:
    """The ASGI scope of a relayed call (`kind` "http" or "websocket") from its request dict:
    path, query, headers and client as the ingress saw them, on a loopback server."""
    client = request.get("client") or ["127.0.0.1", 0]
    return {
        "type": kind,
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "scheme": "http" if kind == "http" else "ws",
        "path": request["path"],
        "raw_path": request["path"].encode(),
        "root_path": "",
        "query_string": request.get("query_string", b""),
        "headers": [(bytes(k).lower(), bytes(v)) for k, v in request.get("headers", [])],
        "client": (client[0], int(client[1])),
        "server": ("127.0.0.1", 0),
        "state": {},
    }
