"""APIError: every refusal the server gives, in OpenAI's error envelope.

`{"error": {"message", "type", "param", "code"}}`. Messages are written for the client and
never carry stack traces, internal paths or keys.
"""

from __future__ import annotations


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None,
                 headers: dict | None = None, extra: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = headers or {}
        self.extra = extra or {}  # more fields inside "error" (e.g. predicted_ttft_ms)

    def to_dict(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code, **self.extra}}


def invalid_value(param: str | None, message: str) -> APIError:
    return APIError(400, message, "invalid_request_error", "invalid_value", param)


def invalid_type(param: str | None, message: str) -> APIError:
    return APIError(400, message, "invalid_request_error", "invalid_type", param)


def invalid_json(message: str, code: str = "invalid_json") -> APIError:
    return APIError(400, message, "invalid_request_error", code, None)


def unsupported(param: str, message: str) -> APIError:
    return APIError(400, message, "invalid_request_error", "unsupported_parameter", param)
