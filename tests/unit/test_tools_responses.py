"""Function tools on the Responses API, driven by hand-made engine outputs: request
validation (params named as the Responses API names them), input items to messages, the
output's `function_call` items, and the stream's per-call events, each call's
`output_item.done` before the response's last event (the agent fast path)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import pytest

from ultrafast.config import DEMO_MODEL_DIR
from ultrafast.server.errors import APIError
from ultrafast.server.frontends.responses import ResponseBuilder
from ultrafast.server.frontends.responses_models import ResponsesRequest
from ultrafast.server.frontends.responses_stream import stream_response
from ultrafast.server.protocol_models import validate_input as validate
from ultrafast.server.tools.responses_api import plan_from_responses
from ultrafast.server.tools.stream import ToolSplitter
from ultrafast.tokenizer import Tokenizer

from .test_generation_run import make_run
from .test_protocol import ALL_FEATURES, LIMITS
from .test_tools_run import feed_tokens

TOOLS = [
    {"type": "function", "name": "get_x", "parameters": {"type": "object"}},
    {"type": "function", "name": "ping"},
]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(DEMO_MODEL_DIR)


def request(**fields) -> ResponsesRequest:
    return validate(ResponsesRequest, {"input": "hi", **fields})


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].name"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [{**TOOLS[0], "parameters": {"type": "array"}}]}, "tools[0].parameters"),
        ({"tools": [{**TOOLS[0], "parameters": {"type": "nope"}}]}, "tools[0].parameters.type"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "z"}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": [{**TOOLS[0], "parameters": {"type": "object", "if": {}}}]},
            "tools[0].parameters.if",
        ),
    ],
)
def test_bad_tools_name_the_param(fields, param):
    with pytest.raises(APIError) as info:
        plan_from_responses(request(**fields), ALL_FEATURES)
    assert (info.value.status, info.value.param) == (400, param)


def test_tools_need_the_feature():
    with pytest.raises(APIError) as info:
        plan_from_responses(request(tools=TOOLS), LIMITS)
    assert info.value.code == "unsupported_parameter"


def test_input_items_become_the_chat_history():
    req = request(
        input=[
            {"role": "user", "content": "weather?"},
            {"type": "function_call", "call_id": "call_a", "name": "get_x", "arguments": "{}"},
            {"type": "function_call", "call_id": "call_b", "name": "ping", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_a", "output": "sunny"},
            {"type": "function_call_output", "call_id": "call_b", "output": "pong"},
        ]
    )
    messages = req.new_messages()
    assert [m.role for m in messages] == ["user", "assistant", "tool", "tool"]
    assert [c["id"] for c in messages[1].extra["tool_calls"]] == ["call_a", "call_b"]
    assert messages[2].extra == {"tool_call_id": "call_a"} and messages[2].content == "sunny"


def test_a_bad_input_item_is_named_by_its_path():
    with pytest.raises(APIError) as info:
        request(input=[{"type": "function_call", "call_id": "c", "arguments": "{}"}])
    assert info.value.param == "input[0].name"


def responses_run(tok, req):
    run, engine = make_run(tok)
    plan = plan_from_responses(req, ALL_FEATURES)
    run.spec = replace(run.spec, tools=plan, stream=True)
    run.tools = ToolSplitter.for_run(plan, run.choices)
    return run, engine, ResponseBuilder("resp_t", req, "m", "default")


def parse_events(chunks: list[bytes]) -> list[dict]:
    out = []
    for chunk in chunks:
        for part in chunk.split(b"\n\n"):
            if part.startswith(b"event: "):
                out.append(json.loads(part.split(b"data: ", 1)[1]))
    return out


def test_stream_sends_each_call_whole_before_the_response_ends(tok):
    async def main():
        req = request(tools=TOOLS, stream=True)
        run, engine, builder = responses_run(tok, req)
        run.start()
        feed_tokens(
            engine,
            tok,
            'Let me check.<tool_call>{"name":"get_x","arguments":{"a":"}"}}</tool_call>'
            '<tool_call>{"name":"ping","arguments":{}}</tool_call>',
        )
        events = parse_events([c async for c in stream_response(run, builder)])
        kinds = [e["type"] for e in events]
        assert kinds[-1] == "response.completed"
        done = [e for e in events if e["type"] == "response.output_item.done"]
        calls = [e["item"] for e in done if e["item"]["type"] == "function_call"]
        assert [(c["name"], c["arguments"]) for c in calls] == [
            ("get_x", '{"a":"}"}'),
            ("ping", "{}"),
        ]
        # the deltas of each call concatenate to its arguments
        for call in calls:
            deltas = [
                e["delta"]
                for e in events
                if e["type"] == "response.function_call_arguments.delta"
                and e["item_id"] == call["id"]
            ]
            assert "".join(deltas) == call["arguments"]
        # output indices: the message first (its text came first), then the calls in order
        final = events[-1]["response"]
        assert [i["type"] for i in final["output"]] == ["message", "function_call", "function_call"]
        assert [e["output_index"] for e in done] == [1, 2, 0]
        assert final["output"][0]["content"][0]["text"] == "Let me check."
        assert [i["call_id"] for i in final["output"][1:]] == [c["call_id"] for c in calls]

    asyncio.run(main())


def test_calls_only_reply_has_no_message_item(tok):
    async def main():
        req = request(tools=TOOLS, tool_choice="required", parallel_tool_calls=False, stream=True)
        run, engine, builder = responses_run(tok, req)
        run.start()
        feed_tokens(engine, tok, '<tool_call>{"name":"ping","arguments":{}}', finish=None)
        events = parse_events([c async for c in stream_response(run, builder)])
        assert engine.aborted  # one call allowed: generation ended at its brace
        final = events[-1]["response"]
        assert events[-1]["type"] == "response.completed"
        assert [i["type"] for i in final["output"]] == ["function_call"]
        assert not any(e["type"] == "response.output_text.delta" for e in events)

    asyncio.run(main())


def test_realtime_call_events_and_items():
    from ultrafast.server.tools.formats import GENERIC
    from ultrafast.server.tools.parse import ToolCallParser
    from ultrafast.server.tools.realtime_events import (
        call_events,
        function_item_created,
        function_item_turn,
    )

    parser = ToolCallParser(GENERIC)
    events = tuple(parser.push('<tool_call>{"name":"ping","arguments":{"a":"}"}}'))
    out = call_events("resp_1", events, 1)
    kinds = [e["type"] for e in out]
    assert kinds == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    assert all(e["output_index"] == 1 for e in out)
    assert out[1]["delta"] == out[2]["arguments"] == '{"a":"}"}'
    assert out[1]["item_id"] == out[2]["item_id"] == out[3]["item"]["id"]
    turn = function_item_turn(
        {"type": "function_call_output", "call_id": out[2]["call_id"], "output": "ok"}, "t1"
    )
    assert turn.role == "tool" and turn.tool_call_id == out[2]["call_id"]
    assert function_item_created(turn)["item"]["type"] == "function_call_output"
    assert function_item_turn({"role": "user", "content": "x"}, "t2") is None
    with pytest.raises(APIError) as info:
        function_item_turn({"type": "function_call", "call_id": "c"}, "t3")
    assert info.value.status == 400
