"""Structured output: `response_format` (chat completions) and `text.format` (Responses API)
turned into a GrammarSpec, checked (schema_check: the keyword's path in the error) and
compiled off the event loop and the engine thread, with a time cap. The compile starts before
the prompt is tokenized and runs while the request prefills (server/calls.py)."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Future, ThreadPoolExecutor

from ultrafast.grammar.spec import GrammarSpec
from ultrafast.server.errors import APIError, bad_request, unsupported_parameter

COMPILE_TIMEOUT_S = 2.0  # llguidance's work limits bound a compile; this bounds the wait

_compile_pool = ThreadPoolExecutor(2, thread_name_prefix="ultrafast-grammar")


def check_schema_param(schema: object, param: str) -> None:
    """400 naming the keyword's path (`param` + ".properties.x.pattern") for a schema we
    cannot enforce exactly. Never weakened: what passes is enforced in full."""
    from ultrafast.grammar.schema_check import SchemaProblem, check_schema

    try:
        check_schema(schema)
    except SchemaProblem as problem:
        raise bad_request(problem.code, problem.param(param), str(problem)) from None


def json_format_grammar(
    kind: str, schema: object = None, strict: bool | None = None, param: str = "response_format"
):
    """GrammarSpec for a format `type` ("text" -> None). A schema no value can match is a
    400 naming the keyword (`param` + its path) before anything is generated."""
    from ultrafast.grammar.schema_check import SchemaProblem

    if kind == "json_object":
        return GrammarSpec.json_object()
    if kind == "json_schema":
        if not isinstance(schema, dict):
            raise TypeError("json_schema needs a schema object")
        try:
            return GrammarSpec.from_json_schema(schema, bool(strict))
        except SchemaProblem as problem:
            raise bad_request(problem.code, problem.param(param), str(problem)) from None
    return None


def start_compile(grammar_runtime, spec: GrammarSpec, param: str) -> Future:
    """Start compiling `spec` (or finding it in the cache) on the compile threads; the
    request may go to the engine meanwhile (it prefills while the grammar compiles)."""
    if grammar_runtime is None:
        raise unsupported_parameter(
            param.split(".")[0], "constrained decoding is not available for this model"
        )
    future = grammar_runtime.start_compile(spec, _compile_pool)
    future.started_s = time.monotonic()
    return future


async def wait_compiled(future: Future, param: str) -> None:
    """400 with `param` if the compile failed or is not done COMPILE_TIMEOUT_S after it
    started (it goes on under llguidance's work limits; its outcome is cached for the next
    call)."""
    from ultrafast.grammar.cache import GrammarError
    from ultrafast.grammar.tokenizer import GrammarUnavailable

    left = COMPILE_TIMEOUT_S - (time.monotonic() - getattr(future, "started_s", time.monotonic()))
    try:
        if future.done():  # a cache hit, or a compile that ended while the prompt was prepared
            future.result()
        else:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), max(left, 0.0))
    except GrammarError as exc:
        raise bad_request("invalid_schema", param, f"the schema does not compile: {exc}") from None
    except GrammarUnavailable:  # a deferred grammar runtime that could not be built
        raise unsupported_parameter(
            param.split(".")[0], "constrained decoding is not available for this model"
        ) from None
    except asyncio.TimeoutError:
        raise APIError(
            400,
            f"the schema did not compile within {COMPILE_TIMEOUT_S:.0f} s; simplify it",
            "invalid_request_error",
            "grammar_too_complex",
            param,
        ) from None


async def compile_grammar(grammar_runtime, spec: GrammarSpec, param: str) -> None:
    """Compile (or find in the cache) and wait: start_compile + wait_compiled."""
    await wait_compiled(start_compile(grammar_runtime, spec, param), param)
