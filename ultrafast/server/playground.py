"""GET /: the browser playground, one self-contained page made once at import: the markup
(static/playground.html) with its style and scripts inlined, so the page needs nothing else
from this server or any other. The scripts stay separate files to keep each one small:
markdown.js (the renderer), conversations.js (key, models, the conversation list),
playground.js (the chat)."""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request as HTTPRequest
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route

STATIC = Path(__file__).parent / "static"
SCRIPTS = ("markdown.js", "conversations.js", "playground.js")  # each uses those before it


def _read(name: str) -> str:
    return (STATIC / name).read_text(encoding="utf-8")


def build_page() -> str:
    read = _read
    page = read("playground.html")
    for marker, text in (
        ("/*STYLE*/", read("playground.css")),
        ("/*SCRIPT*/", "\n".join(read(name) for name in SCRIPTS)),
    ):
        assert page.count(marker) == 1, marker
        page = page.replace(marker, text)
    return page


_PAGE = build_page()


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
