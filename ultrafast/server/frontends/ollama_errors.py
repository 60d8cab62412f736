"""Ollama's error shape: `{"error": "<message>"}` with the HTTP status (400 bad request,
404 unknown model, 401/403 auth, 429/503 busy). The message names the field at fault."""

from __future__ import annotations

from starlette.responses import JSONResponse

from ultrafast.server.errors import APIError

PATHS = ("/api/",)


def owns(path: str) -> bool:
    return path.startswith(PATHS)


def message_of(error: APIError) -> str:
    if error.param and error.param not in error.message:
        return f"{error.param}: {error.message}"
    return error.message


def response(error: APIError, request_id: str) -> JSONResponse:
    return JSONResponse(
        {"error": message_of(error)},
        status_code=error.status,
        headers={**error.headers, "x-request-id": request_id},
    )
