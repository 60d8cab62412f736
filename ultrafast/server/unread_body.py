"""A response sent before its request's body was read to the end closes the connection.

The server answers some requests without reading their body: 413 when the declared or
counted size passes the limit, a 401/403/404/415 refused before the body matters. Kept
alive, such a connection would have to drain the rest of the body before it could read the
next request, and a client that keeps sending held it open indefinitely (each byte pushed
the keep-alive timer back). So the response says `Connection: close`, and uvicorn (h11)
closes the connection once the response is written, reading nothing more.
"""

from __future__ import annotations

from typing import Any

_CLOSE = (b"connection", b"close")


def _expects_body(scope: dict) -> bool:
    for name, value in scope.get("headers", ()):
        if name == b"transfer-encoding":
            return True
        if name == b"content-length" and value.strip() not in (b"", b"0"):
            return True
    return False


class CloseOnUnreadBody:
    """ASGI middleware: adds `Connection: close` to a response that starts while the request
    body is still (partly) unread."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not _expects_body(scope):
            await self.app(scope, receive, send)
            return
        read_all = False

        async def tracked_receive() -> dict:
            nonlocal read_all
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                read_all = True  # the last body chunk, or the client is gone
            return message

        async def closing_send(message: dict) -> None:
            if message["type"] == "http.response.start" and not read_all:
                headers = list(message.get("headers", ()))
                if not any(name.lower() == b"connection" for name, _ in headers):
                    message = {**message, "headers": [*headers, _CLOSE]}
            await send(message)

        await self.app(scope, tracked_receive, closing_send)
