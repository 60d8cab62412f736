"""Tool calls through a GenerationRun, driven by hand-made engine outputs: the body's
`tool_calls` and `finish_reason`, the stream's deltas in OpenAI's shape (concatenated, equal
to the body), a single allowed call ending the generation at its closing brace, and the
opt-in `tool_call.done` event sent before the stream ends."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import pytest

from ultrafast.config import DEMO_MODEL_DIR
from ultrafast.server import openai_format as fmt
from ultrafast.server.bridge import RequestOutput
from ultrafast.server.tools.plan import FunctionTool, ToolPlan
from ultrafast.tokenizer import Tokenizer

from .test_generation_run import make_run

RID = "chatcmpl-t-0-0"
PLAN = ToolPlan(tools=(FunctionTool("get_x"), FunctionTool("ping")))


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(DEMO_MODEL_DIR)


def tool_run(tok, plan, stream=False):
    run, engine = make_run(tok)
    run.spec = replace(run.spec, tools=plan, stream=stream)
    from ultrafast.server.tools.stream import ToolSplitter

    run.tools = ToolSplitter.for_run(plan, run.choices)
    return run, engine


def feed_tokens(engine, tok, text: str, finish: str | None = "stop"):
    ids = tok.encode(text, False)
    feed = engine.callbacks[RID]
    for k, token in enumerate(ids):
        last = k == len(ids) - 1 and finish is not None
        feed(
            RequestOutput(
                RID,
                [token],
                finished=last,
                finish_reason=finish if last else None,
                num_output_tokens=k + 1,
            )
        )
    return ids


def body_of(run, tok):
    return fmt.chat_response(
        "chatcmpl-t", "m", "default", run.choices, run.usage(), tok.decode, False
    )


async def sse_chunks(run) -> list[bytes]:
    return [chunk async for chunk in run._sse([], run.events().__aiter__())]


def stream_calls(chunks: list[bytes]) -> tuple[str, list[dict], str | None]:
    """Content, calls and finish as a client assembles them from the `data:` chunks."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        if not chunk.startswith(b"data: {"):
            continue
        body = json.loads(chunk[6:])
        for choice in body["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            for tc in delta.get("tool_calls", []):
                if "id" in tc:  # the first delta of a call: id, type and name, empty args
                    assert tc["type"] == "function" and tc["function"]["arguments"] == ""
                    calls[tc["index"]] = {"id": tc["id"], **tc["function"]}
                else:
                    assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
                    calls[tc["index"]]["arguments"] += tc["function"]["arguments"]
            finish = choice["finish_reason"] or finish
    return content, [calls[i] for i in sorted(calls)], finish


ARGS = '{"a":"}{\\"","n":[1,{}]}'


def test_parallel_calls_in_the_body_with_finish_reason_tool_calls(tok):
    async def main():
        run, engine = tool_run(tok, PLAN)
        run.start()
        text = f'<tool_call>{{"name":"get_x","arguments":{ARGS}}}</tool_call>'
        feed_tokens(engine, tok, text + '<tool_call>{"name":"ping","arguments":{}}</tool_call>')
        await run._drain()
        message = body_of(run, tok)["choices"][0]
        assert message["finish_reason"] == "tool_calls"
        assert message["message"]["content"] is None
        calls = message["message"]["tool_calls"]
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
            ("get_x", ARGS),
            ("ping", "{}"),
        ]
        assert len({c["id"] for c in calls}) == 2 and engine.aborted == []
        run.finish()

    asyncio.run(main())


def test_a_single_call_ends_the_generation_at_its_closing_brace(tok):
    async def main():
        run, engine = tool_run(tok, replace(PLAN, parallel=False))
        run.start()
        call = '<tool_call>{"name":"ping","arguments":{}}'
        feed_tokens(engine, tok, "Sure. " + call + "</tool_call> and more text", finish=None)
        await run._drain()
        assert engine.aborted == [RID]  # the server asked for no token after the brace
        choice = run.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.text == "Sure. "
        assert [c["function"]["name"] for c in choice.tool_calls] == ["ping"]
        run.finish()

    asyncio.run(main())


def test_streamed_deltas_concatenate_to_the_body(tok):
    async def main():
        run, engine = tool_run(tok, PLAN, stream=True)
        run.start()
        text = f'Let me see.<tool_call>{{"name":"get_x","arguments":{ARGS}}}</tool_call>'
        feed_tokens(engine, tok, text)
        content, calls, finish = stream_calls(await sse_chunks(run))
        body = body_of(run, tok)["choices"][0]
        assert finish == "tool_calls" == body["finish_reason"]
        assert content == "Let me see." == body["message"]["content"]
        assert [{"id": c["id"], **c["function"]} for c in body["message"]["tool_calls"]] == calls

    asyncio.run(main())


def test_tool_call_done_event_is_opt_in_and_comes_before_the_finish(tok):
    async def main():
        for opted in (False, True):
            run, engine = tool_run(tok, replace(PLAN, done_events=opted), stream=True)
            run.start()
            feed_tokens(engine, tok, f'<tool_call>{{"name":"get_x","arguments":{ARGS}}}')
            chunks = await sse_chunks(run)
            named = [i for i, c in enumerate(chunks) if c.startswith(b"event: ")]
            if not opted:
                assert named == []
                continue
            assert len(named) == 1 and chunks[named[0]].startswith(b"event: tool_call.done\n")
            done = json.loads(chunks[named[0]].split(b"data: ", 1)[1])
            assert done["tool_call"]["function"] == {"name": "get_x", "arguments": ARGS}
            finish_at = next(i for i, c in enumerate(chunks) if b'"finish_reason":"tool' in c)
            assert named[0] < finish_at

    asyncio.run(main())


def test_tool_choice_none_leaves_call_text_as_content(tok):
    async def main():
        run, engine = tool_run(tok, replace(PLAN, choice="none"))
        assert run.tools is None
        run.start()
        feed_tokens(engine, tok, '<tool_call>{"name":"ping"}')
        await run._drain()
        assert run.choices[0].tool_calls == [] and run.choices[0].finish_reason == "stop"
        run.finish()

    asyncio.run(main())
