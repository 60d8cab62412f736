"""APIError: every refusal the server gives, in OpenAI's error envelope, and the mapping
of a pydantic ValidationError onto one such refusal with an OpenAI-style `param` path.

`{"error": {"message", "type", "param", "code"}}`. Messages are written for the client and
never carry stack traces, internal paths or keys; client-supplied text is only ever quoted
through `quote()`, which bounds it, so an error body cannot be used to echo megabytes back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pydantic import ValidationError

INVALID_REQUEST = "invalid_request_error"


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str = INVALID_REQUEST,
        code: str | None = None,
        param: str | None = None,
        headers: dict | None = None,
        extra: dict | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = headers or {}
        self.extra = extra or {}  # more fields inside "error" (e.g. predicted_ttft_ms)

    def to_dict(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
                **self.extra,
            }
        }


def quote(value: object, max_chars: int = 40) -> str:
    """repr() of a client value, cut to `max_chars` so refusals stay small."""
    text = repr(value)
    return text if len(text) <= max_chars else text[:max_chars] + "..."


def bad_request(code: str, param: str | None, message: str) -> APIError:
    return APIError(400, message, INVALID_REQUEST, code, param)


def invalid_value(param: str | None, message: str) -> APIError:
    return bad_request("invalid_value", param, message)


def invalid_type(param: str | None, message: str) -> APIError:
    return bad_request("invalid_type", param, message)


def missing_field(param: str) -> APIError:
    return bad_request("missing_required_field", param, f"missing required parameter '{param}'")


def unknown_parameter(param: str) -> APIError:
    return bad_request("unknown_parameter", param, f"unrecognized request argument '{param}'")


def unsupported_parameter(param: str, message: str) -> APIError:
    """A field we know and validated, for a feature this server does not offer (yet)."""
    return bad_request("unsupported_parameter", param, message)


def unsupported_content(param: str, message: str) -> APIError:
    return bad_request("unsupported_content", param, message)


def too_large(code: str, param: str | None, message: str) -> APIError:
    """413 refusals: payload_too_large, prompt_too_large, grammar_too_large."""
    return APIError(413, message, INVALID_REQUEST, code, param)


def invalid_json(message: str, code: str = "invalid_json", param: str | None = None) -> APIError:
    return bad_request(code, param, message)


def unsupported_media_type(message: str) -> APIError:
    return APIError(415, message, INVALID_REQUEST, "unsupported_media_type", None)


# ---- pydantic ValidationError -> APIError ---------------------------------------------------

_PLAIN_DETAIL = {
    "model_type": "expected a JSON object",
    "dict_type": "expected a JSON object",
    "model_attributes_type": "expected a JSON object",
    "list_type": "expected a JSON array",
}  # pydantic's own words name classes


def _error_rank(error_type: str) -> tuple[int, str]:
    """Which error to report when pydantic found several (lowest first), and its code."""
    if error_type == "extra_forbidden":
        return 0, "unknown_parameter"
    if error_type == "missing":
        return 1, "missing_required_field"
    if error_type.endswith(("_type", "_parsing")) or error_type in (
        "int_from_float",
        "union_tag_invalid",
        "union_tag_not_found",
    ):
        return 3, "invalid_type"
    return 2, "invalid_value"


def param_path(
    loc: tuple, body: object, missing: bool = False, skip: frozenset = frozenset()
) -> str | None:
    """('messages', 0, 'content', 'array', 1) -> 'messages[0].content[1]'.

    Walks the body alongside `loc`, so union-member tags (`skip`, absent from the body) drop
    out; a missing key, absent by definition, is kept when it ends the path.
    """
    node, out = body, ""
    for i, part in enumerate(loc):
        if isinstance(part, int) and isinstance(node, list) and 0 <= part < len(node):
            out, node = f"{out}[{part}]", node[part]
        elif isinstance(part, str) and (
            isinstance(node, dict) and part in node or missing and i == len(loc) - 1
        ):
            name = part if len(part) <= 64 else part[:64] + "..."
            out = f"{out}.{name}" if out else name
            node = node.get(part) if isinstance(node, dict) else None
        elif part not in skip:
            break  # cannot be placed in the body: report the nearest known parent
    return out or None


def from_validation_error(
    exc: ValidationError, body: object, union_tags: frozenset = frozenset()
) -> APIError:
    """One APIError for a pydantic ValidationError: unknown fields first, then missing ones,
    then bad values, then bad types; `param` is an OpenAI-style path into `body`."""
    # the first error of the lowest rank (a ValidationError always carries at least one)
    err = min(
        exc.errors(include_url=False, include_input=False),
        key=lambda e: _error_rank(e["type"])[0],
    )
    code = _error_rank(err["type"])[1]
    param = param_path(err["loc"], body, err["type"] == "missing", union_tags)
    if code == "unknown_parameter" and param is not None:
        return unknown_parameter(param)
    if code == "missing_required_field" and param is not None:
        return missing_field(param)
    detail = _PLAIN_DETAIL.get(err["type"], err["msg"])
    if err["type"].startswith("union_tag"):
        detail = f"expected one of the JSON types {err.get('ctx', {}).get('expected_tags')}"
    return bad_request(code, param, f"invalid '{param}': {detail}")
