"""server/structured.py: compile errors, the compile time cap, and no grammar engine."""

import asyncio
import threading

import pytest

from ultrafast.grammar import GrammarSpec
from ultrafast.grammar.cache import GrammarError
from ultrafast.server import structured
from ultrafast.server.errors import APIError

SPEC = GrammarSpec.json_object()


class PoolRuntime:
    """GrammarRuntime.start_compile without a cache: every compile goes to the pool."""

    def start_compile(self, spec, pool):
        return pool.submit(self.compile, spec)


class SlowRuntime(PoolRuntime):
    def __init__(self):
        self.release = threading.Event()

    def compile(self, spec):
        self.release.wait(10)


class FailingRuntime(PoolRuntime):
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
    assert spec is not None and spec.source == "json_schema" and "[1-9][0-9]{1,17}" in spec.lark


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


class RecordingRun:
    """What calls._await_compile uses of a GenerationRun."""

    def __init__(self):
        self.events: list[str] = []

    def start(self):
        self.events.append("start")

    def finish(self):
        self.events.append("finish")


def await_compile(runtime, run, param="response_format"):
    from ultrafast.server import calls

    async def go():
        future = structured.start_compile(runtime, SPEC, param)
        await calls._await_compile(run, future, param)

    asyncio.run(go())


def test_a_compiling_request_is_submitted_before_the_compile_ends():
    runtime, run = SlowRuntime(), RecordingRun()
    threading.Timer(0.05, runtime.release.set).start()
    await_compile(runtime, run)
    assert run.events == ["start"]  # prefilling while it compiled; not ended


def test_a_compile_that_fails_after_submission_ends_the_run_with_a_400():
    class SlowFailure(SlowRuntime):
        def compile(self, spec):
            super().compile(spec)
            raise GrammarError("Unsatisfiable schema")

    runtime, run = SlowFailure(), RecordingRun()
    threading.Timer(0.05, runtime.release.set).start()
    with pytest.raises(APIError) as info:
        await_compile(runtime, run, "tools")
    assert (info.value.status, info.value.code, info.value.param) == (
        400,
        "invalid_schema",
        "tools",
    )
    assert run.events == ["start", "finish"]


def test_a_compile_past_the_cap_ends_the_run_with_a_400(monkeypatch):
    monkeypatch.setattr(structured, "COMPILE_TIMEOUT_S", 0.05)
    runtime, run = SlowRuntime(), RecordingRun()
    try:
        with pytest.raises(APIError) as info:
            await_compile(runtime, run)
    finally:
        runtime.release.set()
    assert info.value.code == "grammar_too_complex" and run.events == ["start", "finish"]


def test_a_finished_compile_is_not_submitted_early():
    from concurrent.futures import Future

    from ultrafast.server import calls

    failed: Future = Future()
    failed.set_exception(GrammarError("Unsatisfiable schema"))  # e.g. a cached failure
    run = RecordingRun()
    with pytest.raises(APIError):
        asyncio.run(calls._await_compile(run, failed, "response_format"))
    assert run.events == ["finish"]  # never reached the engine
