"""Ready in seconds: the port is bound before the model loads, and the server answers while
it loads.

`serve` binds (and listens on) its socket first, so a port already taken is reported at once,
and connections made meanwhile wait in the backlog. Until the model is in, `LoadingApp`
answers every request itself: `/health` and `/ready` say `{"status": "loading"}` with 503 (a
load balancer or a script polling /health sees "not yet", as before, when it was not
listening), any other route a 503 `model_loading` error in OpenAI's shape with Retry-After.
When the model is in, the real app's lifespan is started on the serving loop and every
request from then on goes to it.
"""

from __future__ import annotations

import asyncio
import json
import socket

LOADING_RETRY_AFTER_S = "1"


def bind_listen_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port; a taken port is a ValueError that says so."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ValueError(f"cannot listen on {host}: {exc.strerror}; check --host") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise ValueError(
            f"cannot listen on {host}:{port}: {exc.strerror} (another server on that port?); "
            "choose another with --port"
        ) from None
    sock.set_inheritable(True)
    return sock


async def _send_json(send, status: int, body: dict, headers: list | None = None) -> None:
    payload = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload})


class LoadingApp:
    """The ASGI app while the model loads; `activate(app)` hands over to the real one."""

    def __init__(self) -> None:
        self.app = None
        self._lifespan: asyncio.Task | None = None
        self._lifespan_in: asyncio.Queue = asyncio.Queue()
        self._lifespan_out: asyncio.Queue = asyncio.Queue()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await self._own_lifespan(receive, send)
        elif self.app is not None:
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1013, "reason": "model loading"})
        else:
            await self._loading(scope, send)

    @staticmethod
    async def _loading(scope, send) -> None:
        if scope.get("path") in ("/health", "/ready"):
            await _send_json(send, 503, {"status": "loading"})
            return
        error = {
            "error": {
                "message": "the model is loading; retry in a moment",
                "type": "overloaded_error",
                "param": None,
                "code": "model_loading",
            }
        }
        await _send_json(send, 503, error, [(b"retry-after", LOADING_RETRY_AFTER_S.encode())])

    async def _own_lifespan(self, receive, send) -> None:
        """uvicorn's lifespan: up at once; at shutdown, the real app's lifespan ends first."""
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self._stop_inner()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def activate(self, app) -> None:
        """On the serving loop: run `app`'s lifespan startup, then route everything to it."""
        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}}
        self._lifespan = asyncio.get_running_loop().create_task(
            app(scope, self._lifespan_in.get, self._lifespan_out.put)
        )
        await self._lifespan_in.put({"type": "lifespan.startup"})
        reply = await self._lifespan_out.get()
        if reply["type"] != "lifespan.startup.complete":
            raise RuntimeError(f"the app did not start: {reply.get('message', reply)}")
        self.app = app

    async def _stop_inner(self) -> None:
        if self._lifespan is None or self._lifespan.done():
            return
        await self._lifespan_in.put({"type": "lifespan.shutdown"})
        try:
            await asyncio.wait_for(self._lifespan_out.get(), timeout=10)
        except asyncio.TimeoutError:
            self._lifespan.cancel()
