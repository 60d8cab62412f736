"""Strict JSON bodies: size, UTF-8, no NaN/Infinity, no duplicate keys, no lone surrogates,
bounded nesting, object at the top. Python's json accepts most of these by default.
"""

from __future__ import annotations

import json
import re

from ultrafast.server.errors import APIError, invalid_json

MAX_DEPTH = 64  # deeper JSON is refused before the recursive parser sees it
_ESCAPE = re.compile(r"\\(u[0-9a-fA-F]{4}|.)", re.S)  # every backslash escape, in order
_STRUCTURE = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]')


def check_content_type(value: str | None) -> None:
    media = (value or "").split(";")[0].strip().lower()
    if media != "application/json":
        raise APIError(415, "Content-Type must be application/json", "invalid_request_error",
                       "unsupported_media_type", None)


def _depth_ok(raw: bytes) -> bool:
    depth = 0
    for match in _STRUCTURE.finditer(raw):
        token = match.group()
        if token in (b"[", b"{"):
            depth += 1
            if depth > MAX_DEPTH:
                return False
        elif token in (b"]", b"}"):
            depth -= 1
    return True


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    obj = {}
    for key, value in pairs:
        if key in obj:
            raise ValueError(f"duplicate key {key!r}")
        obj[key] = value
    return obj


def _has_lone_surrogate(text: str) -> bool:
    """A \\uD800-\\uDFFF escape that is not half of an adjacent high+low pair."""
    pending_high, last_end = False, -1
    for match in _ESCAPE.finditer(text):
        adjacent = match.start() == last_end
        if pending_high and not adjacent:
            return True
        escape = match.group(1)
        value = int(escape[1:], 16) if escape[0] == "u" else -1
        if 0xDC00 <= value <= 0xDFFF:
            if not pending_high:
                return True
            pending_high = False
        elif pending_high:
            return True
        else:
            pending_high = 0xD800 <= value <= 0xDBFF
        last_end = match.end()
    return pending_high


def parse_json_body(raw: bytes, max_bytes: int = 4 * 1024 * 1024) -> dict:
    if len(raw) > max_bytes:
        raise APIError(413, f"request body is larger than {max_bytes} bytes",
                       "invalid_request_error", "payload_too_large", None)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise invalid_json("the body is not valid UTF-8", "invalid_utf8") from None
    if "\\u" in text and _has_lone_surrogate(text):
        raise invalid_json("the body contains an unpaired UTF-16 surrogate escape",
                           "invalid_utf8")
    if not _depth_ok(raw):
        raise invalid_json(f"JSON nesting deeper than {MAX_DEPTH} levels")
    try:
        body = json.loads(text, parse_constant=_reject_constant, object_pairs_hook=_no_duplicates)
    except RecursionError:
        raise invalid_json("JSON nesting is too deep") from None
    except ValueError as exc:
        raise invalid_json(f"invalid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise invalid_json("the body must be a JSON object")
    return body
