"""HTTP calls from the ingress straight to a replica on the same machine, past Ray.

A call through a Serve handle pays Ray's hops (the handle's router, the actor call, each
streamed chunk as an object) on every request; on the loopback a plain HTTP connection to the
replica's own socket is cheaper (`python -m ultrafast_harness.cluster.relay_timers` times both; see
docs/ARCHITECTURE.md "Cluster"). Ray keeps placement, health
checks and restarts: each replica serves the single server's app on a 127.0.0.1 port it
reports in its routing stats, and the ingress uses it only for a replica on its own Ray node
(others, and WebSockets, go through the handle).

A refused or broken connection is ReplicaFailed, as a failed handle call is: a dead replica's
socket is closed by the kernel at once, so the call moves on without waiting for Ray.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from typing import Any

import httpx

from ultrafast.cluster.ingress import ReplicaFailed

# hop-by-hop: each connection has its own
_DROP_REQUEST = {b"content-length", b"transfer-encoding", b"connection", b"keep-alive"}
_DROP_RESPONSE = {"content-length", "transfer-encoding", "connection", "keep-alive"}


class CountCalls:
    """ASGI wrapper counting the HTTP calls in progress: the replica's drain waits for them
    (Ray's graceful stop counts only its own calls; EngineReplica.watch holds one open)."""

    def __init__(self, app):
        self.app = app
        self.in_flight = 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        self.in_flight += 1
        try:
            return await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1


async def serve_on_loopback(app) -> tuple[int, asyncio.Task]:
    """Serves `app` on 127.0.0.1 (a free port) from the running loop; returns the port."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(
        app, lifespan="off", log_level="warning", access_log=False, timeout_keep_alive=60
    )
    server = uvicorn.Server(config)
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    return sock.getsockname()[1], task


class DirectHTTP:
    """One connection pool for all replicas' loopback ports."""

    def __init__(self) -> None:
        self._client: httpx.AsyncClient | None = None

    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(
                # no read timeout: a stream's tokens may be far apart; the replica's own
                # limits end stuck calls, and a dead replica's socket is closed at once
                timeout=httpx.Timeout(None, connect=2.0),
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
            )
        return self._client

    async def forward(self, port: int, request: dict) -> AsyncIterator[Any]:
        """As Backends.forward: {"status", "headers"}, then body chunks; ReplicaFailed."""
        headers = [
            (bytes(k), bytes(v))
            for k, v in request.get("headers", [])
            if bytes(k).lower() not in _DROP_REQUEST
        ]
        query = request.get("query_string", b"")
        url = f"http://127.0.0.1:{port}{request['path']}" + (f"?{query.decode()}" if query else "")
        built = self.client().build_request(
            request["method"], url, headers=headers, content=request.get("body", b"")
        )
        try:
            response = await self.client().send(built, stream=True)
        except httpx.TransportError as exc:
            raise ReplicaFailed(f"{type(exc).__name__}: {exc}") from None
        try:
            yield {
                "status": response.status_code,
                "headers": [
                    (k, v)
                    for k, v in response.headers.multi_items()
                    if k.lower() not in _DROP_RESPONSE
                ],
            }
            async for chunk in response.aiter_raw():
                yield chunk
        except httpx.TransportError as exc:  # the replica died mid-answer
            raise ReplicaFailed(f"{type(exc).__name__}: {exc}") from None
        finally:
            await response.aclose()  # the replica sees the client leave, as behind uvicorn

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
