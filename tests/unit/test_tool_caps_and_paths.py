"""The Responses API's `max_tool_calls` (the smaller of it and --max-tool-calls caps the calls
of a turn; 0 allows none; checked and named `max_tool_calls`), and a tool whose parameters no
arguments can match: a 400 naming the keyword's exact path under `tools` (issue 29)."""

from __future__ import annotations

import pytest

from ultrafast.grammar.schema_check import SchemaProblem
from ultrafast.server.errors import APIError
from ultrafast.server.frontends.responses_models import ResponsesRequest, check_request
from ultrafast.server.protocol import parse_chat_request
from ultrafast.server.protocol_models import validate_input as validate
from ultrafast.server.tools.plan import chat_tool_plan
from ultrafast.server.tools.responses_api import plan_from_responses

from .test_protocol import ALL_FEATURES, chat, tool

OK = {"type": "object", "properties": {"q": {"type": "string"}}}
EMPTY = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 4}}}
FLAT = [
    {"type": "function", "name": "get_x", "parameters": OK},
    {"type": "function", "name": "ping"},
]


def responses_plan(**fields):
    return plan_from_responses(validate(ResponsesRequest, {"input": "hi", **fields}), ALL_FEATURES)


@pytest.mark.parametrize(
    ("asked", "server", "most", "single"),
    [(None, 8, 8, False), (1, 8, 1, True), (3, 8, 3, False), (5, 2, 2, False)],
)
def test_the_smaller_of_the_field_and_the_flag_caps_the_calls(asked, server, most, single):
    fields = {} if asked is None else {"max_tool_calls": asked}
    plan = responses_plan(tools=FLAT, **fields).capped(server)
    assert (plan.max_calls, plan.single, plan.calls_allowed) == (most, single, True)
    lark = plan.grammar_lark() or ""  # a call, then at most most - 1 more
    assert f"more_calls_{most - 1}:" not in lark
    assert most == 1 or f"more_calls_{most - 2}:" in lark


def test_zero_calls_allowed_is_as_none():
    plan = responses_plan(tools=FLAT, max_tool_calls=0).capped(8)
    assert not plan.calls_allowed and plan.parser() is None
    assert "~/" in (plan.grammar_lark() or "")  # the trigger is banned from the text


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "name": "ping"}], ids=["required", "named"]
)
def test_zero_calls_with_a_call_required_is_a_400(choice):
    with pytest.raises(APIError) as info:
        responses_plan(tools=FLAT, tool_choice=choice, max_tool_calls=0)
    assert (info.value.status, info.value.param) == (400, "max_tool_calls")


class _State:
    @staticmethod
    def limits_for(model):
        return ALL_FEATURES


@pytest.mark.parametrize("value", [-1, "2", 1.5, True])
def test_max_tool_calls_must_be_a_non_negative_integer(value):
    with pytest.raises(APIError) as info:
        check_request(validate(ResponsesRequest, {"input": "hi", "max_tool_calls": value}), _State)
    assert (info.value.status, info.value.param) == (400, "max_tool_calls")


def test_a_chat_tool_no_arguments_can_match_is_named_by_its_exact_path():
    body = chat(tools=[tool("a", OK), tool("b", EMPTY)])
    plan = chat_tool_plan(parse_chat_request(body, ALL_FEATURES))
    with pytest.raises(SchemaProblem) as info:
        plan.grammar()
    assert info.value.param("tools") == "tools[1].function.parameters.properties.n.minimum"


def test_a_responses_tool_no_arguments_can_match_is_named_by_its_exact_path():
    tools = [FLAT[1], {"type": "function", "name": "get_x", "parameters": EMPTY}]
    with pytest.raises(SchemaProblem) as info:
        responses_plan(tools=tools, tool_choice="required").grammar()
    assert info.value.param("tools") == "tools[1].parameters.properties.n.minimum"


def test_the_path_of_the_named_tool_keeps_its_place_in_the_request():
    tools = [FLAT[1], {"type": "function", "name": "get_x", "parameters": EMPTY}]
    choice = {"type": "function", "name": "get_x"}  # the grammar holds only this one
    with pytest.raises(SchemaProblem) as info:
        responses_plan(tools=tools, tool_choice=choice).grammar()
    assert info.value.param("tools") == "tools[1].parameters.properties.n.minimum"


def test_an_anthropic_tool_no_arguments_can_match_is_named_by_its_exact_path():
    from ultrafast.server.frontends.anthropic_request import parse_request, plan_of

    tools = [{"name": "a", "input_schema": OK}, {"name": "b", "input_schema": EMPTY}]
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    plan = plan_of(parse_request({**body, "tools": tools}, ALL_FEATURES), ALL_FEATURES)
    with pytest.raises(SchemaProblem) as info:
        plan.grammar()
    assert info.value.param("tools") == "tools[1].input_schema.properties.n.minimum"


def test_an_ollama_tool_no_arguments_can_match_is_named_by_its_exact_path():
    from ultrafast.server.frontends.ollama_request import ChatRequest, call_input, parse

    tools = [
        {"type": "function", "function": {"name": n, "parameters": s}}
        for n, s in (("a", OK), ("b", EMPTY))
    ]
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": tools}
    req = parse(ChatRequest, body, ALL_FEATURES)
    plan = call_input(req, "m", ALL_FEATURES, "id").tools
    with pytest.raises(SchemaProblem) as info:
        plan.grammar()
    assert info.value.param("tools") == "tools[1].function.parameters.properties.n.minimum"
