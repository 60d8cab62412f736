"""The cluster ingress's Starlette app: its routes (the relayed API, `/v1/realtime`, health,
readiness, metrics) behind the same Host allow-list and key check as `serve`. Apart from
ingress.py so that the WebSocket relay, which uses the ingress, is imported by neither side of
a cycle."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket

from ultrafast.cluster.ingress import ClusterIngress
from ultrafast.cluster.realtime_relay import relay_realtime
from ultrafast.server import auth
from ultrafast.server.errors import APIError
from ultrafast.server.tenants import ApiKeys


def build_ingress_app(
    ingress: ClusterIngress,
    metrics_route,
    ready_route,
    api_keys: ApiKeys | None = None,
    allowed_hosts: tuple = (),
) -> Starlette:
    async def health(http: HTTPRequest) -> Response:
        return JSONResponse({"status": "ok"})

    async def on_api_error(http: HTTPRequest, exc: APIError) -> Response:
        return JSONResponse(
            exc.to_dict(),
            status_code=exc.status,
            headers={**exc.headers, "x-request-id": uuid.uuid4().hex},
        )

    async def realtime(ws: WebSocket) -> None:
        await relay_realtime(ingress, ws)

    methods = ["GET", "POST", "DELETE", "PUT", "PATCH"]
    routes = [
        WebSocketRoute("/v1/realtime", realtime),
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready_route, methods=["GET"]),
        Route("/metrics", metrics_route, methods=["GET"]),
        Route("/{path:path}", ingress.handle, methods=methods),
    ]
    refused: dict = {}
    middleware = [
        Middleware(auth.HostAllowListMiddleware, allowed_hosts=allowed_hosts),
        Middleware(auth.AuthMiddleware, keys=api_keys, refused=refused),
    ]
    handlers: dict[Any, Callable[..., Awaitable[Response]]] = {APIError: on_api_error}
    return Starlette(routes=routes, middleware=middleware, exception_handlers=handlers)
