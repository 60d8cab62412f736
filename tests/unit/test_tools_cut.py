"""A turn cut by max_tokens inside tool-call markup (issue 29 item 4), through a
GenerationRun fed by hand-made engine outputs: no trigger or closing text in the content,
the body lists only whole calls, the stream's cut call ends with `finish_reason: length`."""

from __future__ import annotations

import asyncio

import pytest

from ultrafast.config import DEMO_MODEL_DIR
from ultrafast.server.tools.formats import GENERIC, HERMES
from ultrafast.server.tools.parse import CallDone, Content, ToolCallParser
from ultrafast.tokenizer import Tokenizer

from .test_tools_run import PLAN, body_of, feed_tokens, sse_chunks, stream_calls, tool_run

WHOLE = '<tool_call>{"name":"ping","arguments":{}}</tool_call>'
CUTS = [  # (the output when max_tokens cut it, how many whole calls it holds)
    ("<tool_", 0),  # inside the trigger
    ("Sure.<tool_call", 0),
    (WHOLE[: -len("_call>")], 1),  # the closing text of a whole call
    (WHOLE + "<tool_call>", 1),  # a block opened, no call yet
    (WHOLE + '<tool_call>{"name":"pi', 1),  # a name not closed
    (WHOLE + '<tool_call>{"name":"ping","arguments":{"a', 1),  # arguments cut
]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(DEMO_MODEL_DIR)


@pytest.mark.parametrize("fmt", [GENERIC, HERMES])
@pytest.mark.parametrize(("text", "whole"), CUTS)
def test_parser_cut_keeps_markup_out_of_content(fmt, text, whole):
    text = text.replace("<tool_call>", fmt.open_text())
    parser = ToolCallParser(fmt)
    events = parser.push(text) + parser.finish(cut=True)
    content = "".join(e.text for e in events if isinstance(e, Content))
    assert content.strip() in ("", "Sure.") and "<" not in content, content
    assert sum(e.complete for e in events if isinstance(e, CallDone)) == whole


def test_parser_not_cut_keeps_its_text():
    parser = ToolCallParser(GENERIC)
    events = parser.push("a < b <tool") + parser.finish()
    assert "".join(e.text for e in events if isinstance(e, Content)) == "a < b <tool"


@pytest.mark.parametrize(("text", "whole"), CUTS)
def test_body_lists_only_whole_calls_and_no_markup(tok, text, whole):
    async def main():
        run, engine = tool_run(tok, PLAN)
        run.start()
        feed_tokens(engine, tok, text, finish="length")
        await run._drain()
        choice = body_of(run, tok)["choices"][0]
        assert choice["finish_reason"] == "length"
        content = choice["message"]["content"] or ""
        assert "<" not in content and "tool" not in content, content
        calls = choice["message"].get("tool_calls") or []
        assert [c["function"]["arguments"] for c in calls] == ["{}"] * whole
        run.finish()

    asyncio.run(main())


@pytest.mark.parametrize(("text", "whole"), CUTS[-1:])
def test_stream_of_a_cut_call_ends_with_length(tok, text, whole):
    async def main():
        run, engine = tool_run(tok, PLAN, stream=True)
        run.start()
        feed_tokens(engine, tok, text, finish="length")
        content, calls, finish = stream_calls(await sse_chunks(run))
        assert finish == "length" and "<" not in content and "tool" not in content
        assert len(calls) == whole + 1  # the cut call's deltas were streamed

    asyncio.run(main())
