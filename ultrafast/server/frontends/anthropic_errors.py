"""Anthropic's error shape: `{"type": "error", "error": {"type", "message"}}` and its codes.

Overload (a full tier queue, the server draining) is 529 `overloaded_error`, which Anthropic's
SDK retries; a rate limit is 429 `rate_limit_error`; a tier the key may not use is 403
`permission_error`. The message names the field at fault (`messages[1].content[0].type: ...`).
"""

from __future__ import annotations

from starlette.responses import JSONResponse

from ultrafast.server.errors import APIError

PATHS = ("/v1/messages",)

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}


def owns(path: str) -> bool:
    return path.startswith(PATHS)


def status_and_type(error: APIError) -> tuple[int, str]:
    if error.type == "overloaded_error":
        return 529, "overloaded_error"
    status = error.status
    if status in _TYPE_BY_STATUS:
        return status, _TYPE_BY_STATUS[status]
    return status, "api_error" if status >= 500 else "invalid_request_error"


def message_of(error: APIError) -> str:
    """The message, led by the field it is about when the message does not say it."""
    if error.param and error.param not in error.message:
        return f"{error.param}: {error.message}"
    return error.message


def body(error: APIError) -> dict:
    _, kind = status_and_type(error)
    return {"type": "error", "error": {"type": kind, "message": message_of(error)}}


def response(error: APIError, request_id: str) -> JSONResponse:
    status, _ = status_and_type(error)
    return JSONResponse(
        body(error),
        status_code=status,
        headers={**error.headers, "request-id": request_id, "x-request-id": request_id},
    )
