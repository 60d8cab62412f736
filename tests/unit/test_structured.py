"""server/structured.py: compile errors, the compile time cap, and no grammar engine."""

import asyncio
import threading

import pytest

from ultrafast.grammar import GrammarSpec
from ultrafast.grammar.cache import GrammarError
from ultrafast.server import structured
from ultrafast.server.errors import APIError

SPEC = GrammarSpec.json_object()


class SlowRuntime:
    def __init__(self):
        self.release = threading.Event()

    def compile(self, spec):
        self.release.wait(10)


class FailingRuntime:
    def compile(self, spec):
        raise GrammarError("Unsatisfiable schema")


def refusal(runtime, param="response_format.json_schema.schema") -> APIError:
    with pytest.raises(APIError) as info:
        asyncio.run(structured.compile_grammar(runtime, SPEC, param))
    return info.value


def test_a_compile_error_names_the_schema_param():
    error = refusal(FailingRuntime())
    assert (error.status, error.code, error.param) == (
        400,
        "invalid_schema",
        "response_format.json_schema.schema",
    )
    assert "Unsatisfiable" in str(error)


def test_a_slow_compile_is_cut_at_the_cap(monkeypatch):
    monkeypatch.setattr(structured, "COMPILE_TIMEOUT_S", 0.05)
    runtime = SlowRuntime()
    try:
        error = refusal(runtime, "text.format.schema")
    finally:
        runtime.release.set()
    assert (error.status, error.code, error.param) == (
        400,
        "grammar_too_complex",
        "text.format.schema",
    )


def test_no_grammar_engine_is_unsupported():
    error = refusal(None, "response_format")
    assert (error.code, error.param) == ("unsupported_parameter", "response_format")


def test_formats_map_to_specs():
    assert structured.json_format_grammar("text") is None
    assert structured.json_format_grammar("json_object") == GrammarSpec.json_object()
    spec = structured.json_format_grammar("json_schema", {"type": "integer"}, True)
    assert spec is not None and spec.source == "json_schema" and '"integer"' in spec.lark


def test_chat_requests_name_the_keyword_path():
    from ultrafast.server.protocol import Limits, parse_chat_request

    limits = Limits(vocab_size=100, features=frozenset({"response_format"}))
    schema = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}
    body = {
        "messages": [{"role": "user", "content": "x"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
    }
    with pytest.raises(APIError) as info:
        parse_chat_request(body, limits)
    assert (info.value.code, info.value.param) == (
        "unsupported_schema",
        "response_format.json_schema.schema.properties.tags.uniqueItems",
    )
    schema["properties"]["tags"].pop("uniqueItems")
    parse_chat_request(body, limits)
