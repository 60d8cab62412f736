"""Strict JSON bodies (docs/RELIABILITY.md 7a, B1-B5, B16, B27, B29, B30): exact status and code."""

import time

import pytest

from ultrafast.server.errors import APIError
from ultrafast.server.json_body import MAX_DEPTH, check_content_type, nesting_ok, parse_json_body

BAD = (400, "invalid_request_error", "invalid_json", None)
BAD_UTF8 = (400, "invalid_request_error", "invalid_utf8", None)


def refusal(fn, *args):
    with pytest.raises(APIError) as info:
        fn(*args)
    e = info.value
    assert set(e.to_dict()["error"]) == {"message", "type", "param", "code"}
    assert "Traceback" not in e.message and "/ultrafast/" not in e.message
    return e.status, e.type, e.code, e.param


CASES = {
    "B1 truncated": (b'{"model":', BAD),
    "B1 truncated string": (b'{"model": "abc', BAD),
    "B1 empty body": (b"", BAD),
    "B2 array": (b"[]", BAD),
    "B2 string": (b'"x"', BAD),
    "B2 number": (b"3", BAD),
    "B2 null": (b"null", BAD),
    "B16 NaN token": (b'{"temperature": NaN}', BAD),
    "B16 Infinity token": (b'{"temperature": Infinity}', BAD),
    "B16 -Infinity token": (b'{"temperature": -Infinity}', BAD),
    "B16 float overflow is Infinity": (b'{"temperature": 1e400}', BAD),
    "B27 byte 0xFF": (b'{"a": "\xff"}', BAD_UTF8),
    "B27 lone high surrogate": (rb'{"a": "\ud800"}', BAD_UTF8),
    "B27 lone low surrogate": (rb'{"a": "x\uDC00y"}', BAD_UTF8),
    "B27 reversed pair": (rb'{"a": "\udc00\ud800"}', BAD_UTF8),
    "B27 surrogate in a key": (rb'{"\ud800": 1}', BAD_UTF8),
    "B29 100k-deep arrays": (b"[" * 100_000, BAD),
    # the param names where the limit is passed (the 65th container)
    "B29 100k-deep objects": (b'{"a":' * 100_000, BAD[:3] + (".".join(["a"] * 64),)),
    "B29 65 deep, balanced": (
        b'{"a":' + b"[" * 64 + b"]" * 64 + b"}",
        BAD[:3] + ("a" + "[0]" * 63,),
    ),
    "B30 duplicate key": (b'{"model":"a","model":"b"}', BAD),
    "B30 nested duplicate key": (b'{"m":[{"role":"user","role":"system"}]}', BAD),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_refusals(case):
    raw, expected = CASES[case]
    assert refusal(parse_json_body, raw) == expected


@pytest.mark.parametrize(
    "value",
    [
        "text/plain",
        None,
        "",
        "application/x-www-form-urlencoded",
        "application/json; charset=latin-1",
        "application/jsonx",
    ],
)
def test_b3_content_type_refused(value):
    assert refusal(check_content_type, value) == (
        415,
        "invalid_request_error",
        "unsupported_media_type",
        None,
    )


@pytest.mark.parametrize(
    "value",
    [
        "application/json",
        "Application/JSON",
        "application/json; charset=utf-8",
        'application/json;charset="UTF-8"',
    ],
)
def test_b3_content_type_accepted(value):
    check_content_type(value)


def test_b4_body_over_the_limit():
    assert refusal(parse_json_body, b"{}" + b" " * 100, 50) == (
        413,
        "invalid_request_error",
        "payload_too_large",
        None,
    )
    assert parse_json_body(b"{}" + b" " * 48, 50) == {}


def test_valid_bodies_are_kept_exactly():
    body = parse_json_body(rb'{"a": "\ud83d\ude00 \u0000 ok", "b": "\\ud800", "c": [1, 2.5, -0.0]}')
    assert body == {"a": "\U0001f600 \x00 ok", "b": "\\ud800", "c": [1, 2.5, -0.0]}
    assert parse_json_body('{"é": "ü"}'.encode()) == {"é": "ü"}


def test_nesting_limit_is_exact_and_ignores_strings():
    assert nesting_ok(b"[" * MAX_DEPTH + b"]" * MAX_DEPTH)
    assert not nesting_ok(b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1))
    assert nesting_ok(b"{[" * 32 + b"]}" * 32)  # mixed kinds count once per level
    assert not nesting_ok(b'{"a":' * 33 + b"[" * 32)
    deep_text = b'{"a": "' + b"[" * 1000 + b'\\" [[[", "b": [[1], [2]]}'
    assert nesting_ok(deep_text) and parse_json_body(deep_text)["b"] == [[1], [2]]
    wide = b'{"m": [' + b",".join([b"[[1]]"] * 10_000) + b"]}"
    assert len(parse_json_body(wide)["m"]) == 10_000


def test_adversarial_bodies_stay_fast():
    """Linear-time checks: these would take seconds (or forever) with a naive scanner. Timed
    in this thread's CPU time, which other processes' load on the machine does not stretch
    (wall-clock time on a shared machine is several times longer)."""
    bodies = [
        b'["' + b'\\"' * (1024 * 1024),  # unterminated string full of escaped quotes
        b"[" * (2 * 1024 * 1024),
        (b"[" * 64 + b"]" * 64) * 16_000,
        b'{"a": "' + b"\\ud83d\\ude00" * 200_000 + b'"}',
    ]
    for raw in bodies:
        start = time.thread_time()
        try:
            parse_json_body(raw)
        except APIError:
            pass
        assert time.thread_time() - start < 1.0
