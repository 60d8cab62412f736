"""GET /: the browser playground (one static page, read once at import; no templating)."""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request as HTTPRequest
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route

_PAGE = (Path(__file__).parent / "static" / "playground.html").read_text(encoding="utf-8")


async def playground(http: HTTPRequest) -> Response:
    # the page only talks to this origin; keep other sites from framing it
    return HTMLResponse(
        _PAGE,
        headers={
            "cache-control": "no-cache",
            "x-frame-options": "DENY",
            "x-content-type-options": "nosniff",
        },
    )


def playground_routes() -> list[Route]:
    return [Route("/", playground, methods=["GET"])]
