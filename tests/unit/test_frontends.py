"""The Anthropic and Ollama front ends' translation into a `CallInput` (server/frontends/),
their error shapes, and the stop string a matcher reports."""

from __future__ import annotations

import pytest

from ultrafast.request import ServiceTier
from ultrafast.server.errors import APIError
from ultrafast.server.frontends import anthropic_errors, error_response_for
from ultrafast.server.frontends.anthropic_request import call_input as anthropic_call
from ultrafast.server.frontends.anthropic_request import parse_request
from ultrafast.server.frontends.ollama_request import ChatRequest, GenerateRequest, parse
from ultrafast.server.frontends.ollama_request import call_input as ollama_call
from ultrafast.server.protocol import Limits
from ultrafast.tokenizer import StopStringMatcher

LIMITS = Limits(vocab_size=1000, features=frozenset({"tools", "response_format"}))
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}


def anthropic(**fields):
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    body.update(fields)
    return anthropic_call(parse_request(body, LIMITS), LIMITS, "msg_1")


def refusal(fn, *args, **kwargs) -> APIError:
    with pytest.raises(APIError) as info:
        fn(*args, **kwargs)
    return info.value


def test_anthropic_blocks_become_the_chat_with_calls_and_results():
    call = anthropic(
        system=[{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
        messages=[
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Let me look."},
                    {"type": "tool_use", "id": "toolu_1", "name": "w", "input": {"city": "Oslo"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": [{"type": "text", "text": "-3C"}],
                    },
                    {"type": "text", "text": "Thanks"},
                ],
            },
        ],
        tools=[{"name": "w", "input_schema": SCHEMA}],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        stop_sequences=["END"],
        top_k=7,
        temperature=0,
    )
    roles = [m.role for m in call.messages]
    assert roles == ["system", "user", "assistant", "tool", "user"]
    assert call.messages[0].content == "Be brief."
    assert call.messages[2].extra["tool_calls"][0]["function"] == {
        "name": "w",
        "arguments": '{"city":"Oslo"}',
    }
    assert call.messages[3].content == "-3C" and call.messages[3].extra["tool_call_id"] == "toolu_1"
    assert call.tools.choice == "required" and call.tools.single
    assert call.stops == ["END"] and call.params.top_k == 7 and call.params.temperature == 0
    assert call.max_tokens == 5 and call.max_tokens_param == "max_tokens"


@pytest.mark.parametrize(
    "tier, expected",
    [
        (None, (ServiceTier.DEFAULT, False)),
        ("auto", (ServiceTier.DEFAULT, True)),
        ("standard_only", (ServiceTier.DEFAULT, False)),
        ("priority", (ServiceTier.PRIORITY, False)),
    ],
)
def test_anthropic_service_tier(tier, expected):
    call = anthropic(**({} if tier is None else {"service_tier": tier}))
    assert (call.tier, call.auto_tier) == expected


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"max_tokens": None}, "max_tokens"),
        (
            {"messages": [{"role": "user", "content": [{"type": "audio"}]}]},
            "messages[0].content[0].type",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
            "messages[0].content[0].text",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "nope"}]}
                ]
            },
            "messages[0].content[0].tool_use_id",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "tool_use", "id": "a", "name": "n", "input": {}}],
                    }
                ]
            },
            "messages[0].content[0].type",
        ),
        (
            {"tool_choice": {"type": "tool"}, "tools": [{"name": "w", "input_schema": SCHEMA}]},
            "tool_choice.name",
        ),
        (
            {
                "tool_choice": {"type": "tool", "name": "x"},
                "tools": [{"name": "w", "input_schema": SCHEMA}],
            },
            "tool_choice",
        ),
        ({"tools": [{"name": "w", "input_schema": {"type": "string"}}]}, "tools[0].input_schema"),
        ({"thinking": {"type": "enabled", "budget_tokens": 10}}, "thinking"),
        ({"stop_sequences": [""]}, "stop_sequences"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_p": 0}, "top_p"),
        (
            {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "{"}]},
            "messages[1].role",
        ),
        (
            {"output_config": {"format": {"type": "json_schema", "schema": []}}},
            "output_config.format.schema",
        ),
        ({"speed": "fast", "service_tier": "standard_only"}, "speed"),
        (
            {"messages": [{"role": "user", "content": [{"type": {"k": None}}]}]},
            "messages[0].content[0].type",
        ),
    ],
)
def test_anthropic_refusals_name_the_field(fields, param):
    body = {
        "model": "m",
        "max_tokens": 5,
        "messages": [{"role": "user", "content": "hi"}],
        **fields,
    }
    body = {k: v for k, v in body.items() if v is not None}
    error = refusal(lambda: anthropic_call(parse_request(body, LIMITS), LIMITS, "msg_1"))
    assert error.status == 400 and error.param == param


def test_anthropic_error_shapes_and_overload_is_529():
    full = APIError(
        503, "queue full", "overloaded_error", "queue_full", None, headers={"Retry-After": "2"}
    )
    r = anthropic_errors.response(full, "req_1")
    assert r.status_code == 529 and r.headers["retry-after"] == "2"
    assert anthropic_errors.body(full) == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "queue full"},
    }
    denied = APIError(
        403, "no priority", "permission_error", "priority_not_allowed", "service_tier"
    )
    assert anthropic_errors.body(denied)["error"] == {
        "type": "permission_error",
        "message": "service_tier: no priority",
    }
    ollama = error_response_for("/api/chat", denied, "r")
    assert ollama.status_code == 403 and ollama.body == b'{"error":"service_tier: no priority"}'
    openai = error_response_for("/v1/chat/completions", denied, "r")
    assert b'"code":"priority_not_allowed"' in openai.body


def ollama(kind=ChatRequest, **fields):
    body = (
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        if kind is ChatRequest
        else {
            "model": "m",
            "prompt": "hi",
        }
    )
    body.update(fields)
    return ollama_call(parse(kind, body, LIMITS), "m", LIMITS, "r1")


def test_ollama_options_map_onto_sampling():
    call = ollama(
        options={
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": 12,
            "min_p": 0.05,
            "seed": 7,
            "stop": ["\n\n"],
            "num_predict": 30,
            "num_ctx": 4096,
            "repeat_penalty": 1.1,
            "num_thread": 4,  # Ollama's runner option: accepted, ignored
        },
        keep_alive="10m",
    )
    p = call.params
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (0.5, 0.9, 12, 0.05, 7)
    assert p.repetition_penalty == 1.1 and call.stops == ["\n\n"] and call.max_tokens == 30
    assert call.keep_alive == "10m" and call.stream is True  # Ollama streams by default
    assert ollama(options={"num_predict": -1}).max_tokens is None


def test_ollama_messages_tools_and_format():
    call = ollama(
        messages=[
            {"role": "user", "content": "go"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"function": {"name": "move", "arguments": {"x": 1}}}],
            },
            {"role": "tool", "content": "done", "tool_name": "move"},
        ],
        tools=[{"type": "function", "function": {"name": "move", "parameters": SCHEMA}}],
        format={"type": "object"},
    )
    call_id = call.messages[1].extra["tool_calls"][0]["id"]
    assert call.messages[1].extra["tool_calls"][0]["function"]["arguments"] == '{"x":1}'
    assert call.messages[2].extra["tool_call_id"] == call_id
    assert call.tools is not None and call.params.grammar is not None
    assert call.grammar_param == "format"


def test_ollama_generate_raw_is_a_plain_completion():
    raw = ollama(GenerateRequest, raw=True, system="ignored when raw")
    assert raw.chat is False and raw.prompts == ["hi"]
    templated = ollama(GenerateRequest, system="Be brief.")
    assert templated.chat and [m.role for m in templated.messages] == ["system", "user"]


@pytest.mark.parametrize(
    "kind, fields, param",
    [
        (ChatRequest, {"options": {"temperature": "hot"}}, "options.temperature"),
        (ChatRequest, {"options": {"temperature": True}}, "options.temperature"),
        (ChatRequest, {"options": {"seed": 1.5}}, "options.seed"),
        (ChatRequest, {"options": {"top_p": 5}}, "options.top_p"),
        (ChatRequest, {"options": {"repeat_penalty": 0}}, "options.repeat_penalty"),
        (ChatRequest, {"options": {"num_predict": 0}}, "options.num_predict"),
        (ChatRequest, {"options": {"num_ctx": 0}}, "options.num_ctx"),
        (ChatRequest, {"options": {"nonsense": 1}}, "options.nonsense"),
        (ChatRequest, {"options": {"stop": "x"}}, None),  # a single string is accepted
        (ChatRequest, {"format": 3}, "format"),
        (ChatRequest, {"think": True}, "think"),
        (ChatRequest, {"service_tier": "gold"}, "service_tier"),
        (
            ChatRequest,
            {"messages": [{"role": "user", "content": "x", "images": ["a"]}]},
            "messages[0].images",
        ),
        (GenerateRequest, {"images": ["a"]}, "images"),
        (GenerateRequest, {"suffix": "x"}, "suffix"),
        (GenerateRequest, {"context": [1, 2]}, "context"),
        (ChatRequest, {"messages": [{"role": "assistant", "content": "x"}]}, "messages[0].role"),
    ],
)
def test_ollama_refusals_name_the_field(kind, fields, param):
    if param is None:
        assert ollama(kind, **fields).stops == ["x"]
        return
    error = refusal(ollama, kind, **fields)
    assert error.status == 400 and error.param == param


def test_stop_matcher_reports_which_stop_ended_the_text():
    matcher = StopStringMatcher(["END", "##"])
    assert matcher.push("abc #") == ("abc ", False) and matcher.matched is None
    assert matcher.push("# then END") == ("abc "[4:], True)
    assert matcher.matched == "##"  # the earliest in the text, not the first listed


def test_ollama_calls_are_objects_and_cut_ones_empty():
    from ultrafast.server.frontends.ollama import ollama_calls

    calls = (
        {"function": {"name": "a", "arguments": '{"x":1}'}},
        {"function": {"name": "b", "arguments": '{"x'}},
    )
    assert ollama_calls(calls) == [
        {"function": {"name": "a", "arguments": {"x": 1}}},
        {"function": {"name": "b", "arguments": {}}},
    ]


def test_x_api_key_maps_to_the_same_tenant_as_bearer():
    from ultrafast.server.auth import authenticate
    from ultrafast.server.tenants import hash_key, parse_api_keys

    keys = parse_api_keys({"tenants": [{"name": "acme", "keys": [{"sha256": hash_key("k-1")}]}]})

    def scope(*headers):
        return {"type": "http", "path": "/v1/messages", "headers": list(headers)}

    assert authenticate(keys, scope((b"x-api-key", b"k-1"))).name == "acme"
    assert authenticate(keys, scope((b"authorization", b"Bearer k-1"))).name == "acme"
    for bad in [((b"x-api-key", b"k-2"),), ((b"x-api-key", b" "),), ((b"x-api-key", b"k-1"),) * 2]:
        error = refusal(authenticate, keys, scope(*bad))
        assert error.status == 401 and error.type == "authentication_error"


def test_key_tier_is_the_best_default_the_key_may_use():
    from ultrafast.server.auth import SCOPE_KEY
    from ultrafast.server.frontends.common import key_tier
    from ultrafast.server.tenants import Tenant

    def scope(*tiers):
        return {SCOPE_KEY: Tenant("t", tiers=frozenset(tiers))}

    assert key_tier({}) == ServiceTier.DEFAULT  # no keys: the anonymous tenant
    assert key_tier(scope(ServiceTier.FLEX)) == ServiceTier.FLEX
    assert key_tier(scope(ServiceTier.PRIORITY)) == ServiceTier.PRIORITY
    assert key_tier(scope(*ServiceTier)) == ServiceTier.DEFAULT
    call = anthropic_call(
        parse_request(
            {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}, LIMITS
        ),
        LIMITS,
        "msg_1",
        ServiceTier.FLEX,
    )
    assert call.tier == ServiceTier.FLEX
