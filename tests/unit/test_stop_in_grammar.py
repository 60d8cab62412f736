"""A client `stop` string that cuts a constrained answer (issue 29 item 2): the answer ends
`length`, logged, never `stop`; a stop where the grammar's answer is complete stays `stop`.
On the demo vocabulary's real matcher (grammar/prefix_check.py), and through a
GenerationRun fed by hand-made engine outputs: JSON schemas, streamed and not, and tool
calls (a stop inside a call is a cut call: only whole calls listed, no markup in content)."""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import replace

import pytest

from tests.unit.test_grammar_engine import runtime as runtime  # noqa: F401 (fixture)
from tests.unit.test_grammar_engine import tok as tok  # noqa: F401 (fixture)
from ultrafast.grammar import GrammarSpec
from ultrafast.grammar.prefix_check import accepts_text
from ultrafast.request import SamplingParams
from ultrafast.server.tools.stream import ToolSplitter

from .test_generation_run import make_run
from .test_tools_run import PLAN, body_of, feed_tokens, sse_chunks, stream_calls

SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "string"}, "n": {"type": "integer"}},
    "required": ["a", "n"],
    "additionalProperties": False,
}
ANSWER = '{"a":"x: y","n":123}'
CALL = '<tool_call>{"name":"ping","arguments":{}}</tool_call>'


def spec_of(runtime, spec: GrammarSpec) -> GrammarSpec:
    runtime.compile(spec)
    return spec


@pytest.mark.parametrize(
    ("text", "complete"),
    [
        (ANSWER, True),
        (ANSWER[:-1], False),  # the object not closed
        ('{"a":"x', False),  # inside a string
        ('{"a":"x: y","n":12', False),  # a number that could end, inside an object
        ("{", False),
        ("", False),
    ],
)
def test_the_matcher_says_whether_the_text_is_a_whole_answer(runtime, tok, text, complete):
    spec = spec_of(runtime, GrammarSpec.from_json_schema(SCHEMA))
    ids = tok.encode(ANSWER, False) + [tok.eos_token_ids[0]]
    assert accepts_text(runtime, spec, ids, text) is complete


def test_a_number_that_could_go_on_is_still_a_whole_answer(runtime, tok):
    spec = spec_of(runtime, GrammarSpec.from_json_schema({"type": "integer"}))
    assert accepts_text(runtime, spec, tok.encode("123", False), "12")


def test_text_the_tokens_spell_otherwise_is_tokenized_anew(runtime, tok):
    spec = spec_of(runtime, GrammarSpec.from_json_schema(SCHEMA))
    other = tok.encode('{"a":"z"}', False)  # ids of another text: the text decides
    assert accepts_text(runtime, spec, other, ANSWER)
    assert not accepts_text(runtime, spec, other, ANSWER[:-3])


def constrained_run(tok, runtime, spec, stops, stream=False, plan=None):
    run, engine = make_run(
        tok,
        params=SamplingParams(max_tokens=64, grammar=spec),
        stops=stops,
        grammar_runtime=runtime,
        stream=stream,
        tools=plan,
    )
    run.tools = ToolSplitter.for_run(plan, run.choices)
    return run, engine


def finish_of(chunks: list[bytes]) -> list[str]:
    out = []
    for chunk in chunks:
        if chunk.startswith(b"data: {"):
            out += [c["finish_reason"] for c in json.loads(chunk[6:])["choices"]]
    return [f for f in out if f]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_stop_inside_a_json_answer_ends_length_and_is_logged(tok, runtime, stream, caplog):
    spec = spec_of(runtime, GrammarSpec.from_json_schema(SCHEMA))

    async def main():
        run, engine = constrained_run(tok, runtime, spec, [": "], stream)
        run.start()
        feed_tokens(engine, tok, ANSWER)
        if stream:
            assert finish_of(await sse_chunks(run)) == ["length"]
        else:
            await run._drain()
            choice = body_of(run, tok)["choices"][0]
            assert choice["finish_reason"] == "length"
            assert choice["message"]["content"] == '{"a":"x'
        run.finish()

    with caplog.at_level(logging.WARNING, logger="ultrafast.server.generate"):
        asyncio.run(main())
    assert any("finishing with 'length'" in r.getMessage() for r in caplog.records)


def test_a_stop_where_the_answer_is_complete_stays_stop(tok, runtime):
    spec = spec_of(runtime, GrammarSpec.from_json_schema({"type": "integer"}))

    async def main():
        run, engine = constrained_run(tok, runtime, spec, ["3"])
        run.start()
        feed_tokens(engine, tok, "123")
        await run._drain()
        choice = body_of(run, tok)["choices"][0]
        assert (choice["finish_reason"], choice["message"]["content"]) == ("stop", "12")
        run.finish()

    asyncio.run(main())


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_stop_inside_a_tool_call_is_a_cut_call(tok, runtime, stream):
    plan = replace(PLAN, choice="required")
    spec = spec_of(runtime, plan.grammar())
    second = '<tool_call>{"name":"get_x","arguments":{}}</tool_call>'

    async def main():
        run, engine = constrained_run(tok, runtime, spec, ['"get_x"'], stream, plan)
        run.start()
        feed_tokens(engine, tok, CALL + second)
        if stream:
            content, calls, finish = stream_calls(await sse_chunks(run))
            assert finish == "length" and "<" not in content
        else:
            await run._drain()
            choice = body_of(run, tok)["choices"][0]
            assert choice["finish_reason"] == "length"
            assert not choice["message"]["content"]
            names = [c["function"]["name"] for c in choice["message"]["tool_calls"]]
            assert names == ["ping"]  # the whole call only
        run.finish()

    asyncio.run(main())


def test_a_stop_in_free_text_before_any_call_stays_stop(tok, runtime):
    spec = spec_of(runtime, PLAN.grammar())

    async def main():
        run, engine = constrained_run(tok, runtime, spec, ["Bye"], plan=PLAN)
        run.start()
        feed_tokens(engine, tok, "Hello there. Bye now")
        await run._drain()
        choice = body_of(run, tok)["choices"][0]
        assert choice["finish_reason"] == "stop"
        assert choice["message"]["content"] == "Hello there. "
        run.finish()

    asyncio.run(main())
