"""One WebSocket into an ASGI app in this process, driven by plain messages: the replica side of
the ingress's `/v1/realtime` relay (replica.py), and the tests' in-process replicas.

A Ray handle carries calls, not sockets, so a connection is two kinds of call on the same
replica: `open(conn_id, request)` streams what the app sends ({"type": "accept"}, {"type":
"text"|"bytes", "data"}, {"type": "close", "code", "reason"}), and `push(conn_id, message)`
hands it what the client sent ({"type": "text"|"bytes", "data"} or {"type": "disconnect"}).
The request dict is the HTTP relay's (asgi_call.py) with the query string.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from ultrafast.cluster.asgi_call import base_scope

CLOSE_TIMEOUT_S = 5.0  # an app that ignores the client's disconnect is cancelled after it


class WebSocketCalls:
    def __init__(self, app):
        self.app = app
        self._inbox: dict[str, asyncio.Queue] = {}

    async def push(self, conn_id: str, message: dict) -> bool:
        """The client's message to its connection; False when that connection is gone."""
        inbox = self._inbox.get(conn_id)
        if inbox is None:
            return False
        await inbox.put(message)
        return True

    async def open(self, conn_id: str, request: dict) -> AsyncIterator[dict]:
        inbox: asyncio.Queue = asyncio.Queue()
        outbox: asyncio.Queue = asyncio.Queue()
        self._inbox[conn_id] = inbox
        connected = False

        async def receive() -> dict:
            nonlocal connected
            if not connected:
                connected = True
                return {"type": "websocket.connect"}
            message = await inbox.get()
            if message["type"] == "text":
                return {"type": "websocket.receive", "text": message["data"]}
            if message["type"] == "bytes":
                return {"type": "websocket.receive", "bytes": message["data"]}
            return {"type": "websocket.disconnect", "code": int(message.get("code", 1000))}

        async def send(message: dict) -> None:
            await outbox.put(message)

        task = asyncio.get_running_loop().create_task(self.app(_scope(request), receive, send))
        task.add_done_callback(lambda _: outbox.put_nowait(None))
        try:
            while True:
                message = await outbox.get()
                if message is None:  # the app returned without closing: close for it
                    if not task.cancelled() and task.exception() is not None:
                        yield {"type": "close", "code": 1011, "reason": "internal error"}
                    else:
                        yield {"type": "close", "code": 1000, "reason": ""}
                    return
                kind = message["type"]
                if kind == "websocket.accept":
                    yield {"type": "accept"}
                elif kind == "websocket.send":
                    if message.get("text") is not None:
                        yield {"type": "text", "data": message["text"]}
                    else:
                        yield {"type": "bytes", "data": bytes(message.get("bytes") or b"")}
                elif kind in ("websocket.close", "websocket.http.response.start"):
                    yield {
                        "type": "close",
                        "code": int(message.get("code", 1000)),
                        "reason": str(message.get("reason") or ""),
                    }
                    return
        finally:
            # the ingress went away (client left, or it gave up): the app sees a disconnect
            inbox.put_nowait({"type": "disconnect", "code": 1001})
            self._inbox.pop(conn_id, None)
            if not task.done():
                try:
                    await asyncio.wait_for(asyncio.shield(task), CLOSE_TIMEOUT_S)
                except asyncio.CancelledError:  # our caller is cancelled: so is the app
                    task.cancel()
                    raise
                except Exception:  # its own error, or the timeout: ends it
                    task.cancel()


def _scope(request: dict) -> dict[str, Any]:
    return {**base_scope(request, "websocket"), "subprotocols": []}
