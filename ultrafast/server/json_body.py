"""Strict JSON request bodies: the only place raw request bytes become a dict.

Python's `json` is lenient where a server must not be, so each gap is closed here:
- size first (413), before any decoding work;
- UTF-8 only; a lone surrogate escape such as "\\ud800" is refused at parse time, because
  `json` accepts it and the `.encode()` much later (tokenizer, SSE, Redis) would raise;
- NaN / Infinity / -Infinity tokens, and numbers that overflow a float (1e400 is inf);
- duplicate keys, so a proxy and this server can never read different values from one body;
- nesting deeper than MAX_DEPTH, measured without recursion before `json` (which recurses in
  C and raises RecursionError near 1000 levels) ever sees the text;
- a top level that is not an object.
Every refusal is an APIError with code `invalid_json` (or `invalid_utf8`).
"""

from __future__ import annotations

import json
import math
import re

import numpy as np

from ultrafast.server.errors import invalid_json, quote, too_large, unsupported_media_type

MAX_BODY_BYTES = 4 * 1024 * 1024
MAX_DEPTH = 64  # far above any real request; far below the interpreter's recursion limit

# A JSON string, or an unterminated one running to the end of the body. The closing quote is
# optional so that a match can never fail once started: a failing string match rescanned from
# every later quote would make `"\"\"\"...` quadratic.
_STRING = re.compile(rb'"(?:[^"\\]+|\\.)*"?', re.S)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_BRACKET_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")  # +1 / -1 as int8
# Cheap trigger only: "\ud800"-"\udfff" escapes (or an escaped backslash before such text).
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def check_content_type(value: str | None) -> None:
    """415 unless `application/json`, optionally with `charset=utf-8` (B3)."""
    media, _, params = (value or "").partition(";")
    if media.strip().lower() != "application/json":
        raise unsupported_media_type("Content-Type must be application/json")
    for param in params.split(";"):
        name, _, charset = param.partition("=")
        if name.strip().lower() == "charset" and charset.strip().strip('"').lower() not in (
            "utf-8",
            "utf8",
        ):
            raise unsupported_media_type("the only charset accepted is utf-8")


def nesting_ok(raw: bytes, max_depth: int = MAX_DEPTH) -> bool:
    """True when brackets outside strings nest at most `max_depth` deep.

    C-speed throughout (regex, translate, numpy cumsum: ~25 ms for 4 MiB of brackets); a
    Python loop over the body would take seconds on the adversarial cases.
    """
    if raw.count(b"[") + raw.count(b"{") <= max_depth:
        return True  # depth cannot exceed the number of opening brackets
    steps = _STRING.sub(b"", raw).translate(_BRACKET_STEPS, _NOT_BRACKETS)
    if len(steps) <= max_depth:
        return True
    depth = np.cumsum(np.frombuffer(steps, dtype=np.int8), dtype=np.int64)
    return int(depth.max()) <= max_depth


# strings (keys among them) and the punctuation that moves a JSON path
_PATH_TOKEN = re.compile(rb'"(?:[^"\\]+|\\.)*"?|[\[\]{},:]', re.S)
_PATH_SCAN_TOKENS = 200_000  # an error path is a courtesy: never a slow refusal


def too_deep_param(raw: bytes, max_depth: int = MAX_DEPTH) -> str | None:
    """The path (`a.b[3].c`) to the first container nested deeper than `max_depth`, for
    the 400's `param`; None when it is not found within the scan budget."""
    stack: list[list] = []  # [is_object, key or index, expecting a key]
    for count, match in enumerate(_PATH_TOKEN.finditer(raw)):
        if count > _PATH_SCAN_TOKENS:
            return None
        token = match.group()
        if token in (b"{", b"["):
            if not stack and token == b"[":
                return None  # not an object at all: there is no field to name
            if len(stack) >= max_depth:
                return _path_text(stack)
            stack.append([token == b"{", None if token == b"{" else 0, token == b"{"])
        elif token in (b"}", b"]"):
            if stack:
                stack.pop()
        elif token == b",":
            if stack and stack[-1][0]:
                stack[-1][2] = True
            elif stack:
                stack[-1][1] += 1
        elif token == b":":
            if stack:
                stack[-1][2] = False
        elif stack and stack[-1][0] and stack[-1][2]:  # a key
            try:
                stack[-1][1] = json.loads(token)
            except ValueError:
                return None
    return None


def _path_text(stack: list[list]) -> str | None:
    parts = [f"[{key}]" if not is_object else f".{key}" for is_object, key, _ in stack]
    return "".join(parts).lstrip(".") or None


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:20]} is out of range")
    return value


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen = set()
        for key, _ in pairs:
            if key in seen:
                raise ValueError(f"duplicate key {quote(key)}")
            seen.add(key)
    return obj


def _has_lone_surrogate(body: dict) -> bool:
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def parse_json_body(raw: bytes, max_bytes: int = MAX_BODY_BYTES) -> dict:
    """The request body as a dict, or an APIError (400 invalid_json / invalid_utf8, 413)."""
    if len(raw) > max_bytes:
        raise too_large("payload_too_large", None, f"request body is larger than {max_bytes} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise invalid_json("the body is not valid UTF-8", "invalid_utf8") from None
    if not text.strip():
        raise invalid_json("the body is empty; send a JSON object")
    if not nesting_ok(raw):
        raise invalid_json(
            f"JSON nesting is deeper than {MAX_DEPTH} levels", param=too_deep_param(raw)
        )
    try:
        body = json.loads(
            text,
            parse_constant=_reject_constant,
            parse_float=_finite_float,
            object_pairs_hook=_no_duplicates,
        )
    except RecursionError:  # not expected after nesting_ok; never a 500 if it happens
        raise invalid_json("JSON nesting is too deep") from None
    except ValueError as exc:  # JSONDecodeError, and the hooks above
        raise invalid_json(f"invalid JSON: {str(exc)[:200]}") from None
    if not isinstance(body, dict):
        raise invalid_json("the body must be a JSON object")
    if _SURROGATE_ESCAPE.search(text) and _has_lone_surrogate(body):
        raise invalid_json("the body contains an unpaired UTF-16 surrogate escape", "invalid_utf8")
    return body
