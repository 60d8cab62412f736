"""Anthropic's Messages API on the real server (demo model), through the official `anthropic`
SDK and raw HTTP: messages.create, messages.stream (text and a tool call), a tool loop with
tool_result, count_tokens, stop reasons, usage from the prefix cache, and refusals in
Anthropic's error shape naming the field."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from ultrafast_harness.bench.server_process import ServerProcess

anthropic = pytest.importorskip("anthropic", reason="the anthropic SDK is in the test extras")

MODEL = "demo-code"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [{"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
# this SDK release no longer lists temperature; the API (and this server) still take it
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def srv():
    server = ServerProcess("--priority-ttft-ms", "10000", max_model_len=1024)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(srv):
    return anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0)


def post(srv, path: str, body: dict, **headers) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, headers=headers, timeout=60)


def error_of(r: httpx.Response) -> tuple[int, str, str]:
    body = r.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    return r.status_code, body["error"]["type"], body["error"]["message"]


def test_create_text_usage_and_prefix_cache(client):
    first = client.messages.create(
        model=MODEL, max_tokens=8, extra_body=GREEDY, system="You write Python.", messages=ASK
    )
    assert first.type == "message" and first.role == "assistant" and first.id.startswith("msg_")
    assert first.content[0].type == "text" and first.content[0].text
    assert first.stop_reason in ("max_tokens", "end_turn")
    assert first.usage.output_tokens >= 1
    again = client.messages.create(
        model=MODEL, max_tokens=8, extra_body=GREEDY, system="You write Python.", messages=ASK
    )
    assert again.content[0].text == first.content[0].text  # greedy
    # the second call reads the prompt from the prefix cache: Anthropic's split of the tokens
    assert again.usage.cache_read_input_tokens > 0
    total = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == total


def test_stop_sequence_is_reported(client):
    free = client.messages.create(model=MODEL, max_tokens=16, extra_body=GREEDY, messages=ASK)
    text = free.content[0].text
    assert len(text) >= 3
    stop = text[1:3]
    cut = client.messages.create(
        model=MODEL, max_tokens=16, extra_body=GREEDY, messages=ASK, stop_sequences=[stop, "@@@"]
    )
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[: text.index(stop)]


def test_stream_text_matches_create(client):
    whole = client.messages.create(model=MODEL, max_tokens=12, extra_body=GREEDY, messages=ASK)
    with client.messages.stream(model=MODEL, max_tokens=12, extra_body=GREEDY, messages=ASK) as s:
        events = [e.type for e in s]
        final = s.get_final_message()
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "content_block_start" in events and "content_block_stop" in events
    assert "message_delta" in events


def test_raw_stream_event_order(srv):
    body = {"model": MODEL, "max_tokens": 4, "temperature": 0, "messages": ASK, "stream": True}
    with httpx.stream("POST", srv.url + "/v1/messages", json=body, timeout=60) as r:
        assert r.status_code == 200
        names = [line[7:] for line in r.iter_lines() if line.startswith("event: ")]
    assert names[:2] == ["message_start", "ping"]
    assert names[2] == "content_block_start" and names[-2:] == ["message_delta", "message_stop"]
    assert names[-3] == "content_block_stop"
    assert set(names[3:-3]) == {"content_block_delta"}


def test_stream_tool_call_with_input_json_delta(client):
    with client.messages.stream(
        model=MODEL,
        max_tokens=80,
        extra_body=GREEDY,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},  # ends at the call
    ) as s:
        kinds = [(e.type, getattr(getattr(e, "delta", None), "type", None)) for e in s]
        final = s.get_final_message()
    assert ("content_block_delta", "input_json_delta") in kinds
    assert final.stop_reason == "tool_use"
    calls = [b for b in final.content if b.type == "tool_use"]
    assert len(calls) >= 1 and calls[0].name == "get_weather"
    assert calls[0].id.startswith("toolu_")
    jsonschema.validate(calls[0].input, WEATHER)


def test_tool_loop_with_tool_result(client):
    first = client.messages.create(
        model=MODEL,
        max_tokens=80,
        extra_body=GREEDY,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
    )
    assert first.stop_reason == "tool_use"
    call = next(b for b in first.content if b.type == "tool_use")
    jsonschema.validate(call.input, WEATHER)
    history = [
        *ASK,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny"}],
        },
    ]
    answer = client.messages.create(
        model=MODEL,
        max_tokens=8,
        extra_body=GREEDY,
        messages=history,
        tools=TOOLS,
        tool_choice={"type": "none"},
    )
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert all(b.type == "text" for b in answer.content)
    # the loop's prompt starts with the first call's: read from the prefix cache
    assert answer.usage.cache_read_input_tokens > 0


def test_output_config_format_is_enforced(client):
    point = {
        "type": "object",
        "properties": {"x": {"type": "integer"}},
        "required": ["x"],
        "additionalProperties": False,
    }
    r = client.messages.create(
        model=MODEL,
        max_tokens=40,
        extra_body=GREEDY,
        messages=ASK,
        output_config={"format": {"type": "json_schema", "schema": point}},
    )
    jsonschema.validate(json.loads(r.content[0].text), point)


def test_speed_fast_is_the_priority_tier(srv, client):
    r = client.messages.with_raw_response.create(
        model=MODEL, max_tokens=2, messages=ASK, speed="fast"
    )
    assert r.headers["x-service-tier"] == "priority"
    assert r.parse().usage.service_tier == "priority"


def test_count_tokens_matches_the_call(client):
    counted = client.messages.count_tokens(model=MODEL, messages=ASK, system="Be short.")
    made = client.messages.create(
        model=MODEL, max_tokens=1, extra_body=GREEDY, messages=ASK, system="Be short."
    )
    assert counted.input_tokens == made.usage.input_tokens + made.usage.cache_read_input_tokens
    with_tools = client.messages.count_tokens(model=MODEL, messages=ASK, tools=TOOLS)
    assert with_tools.input_tokens > counted.input_tokens  # the tools are in the prompt


def test_auth_headers_accepted_without_keys(srv):
    body = {"model": MODEL, "max_tokens": 2, "messages": ASK}
    r = post(srv, "/v1/messages", body, **{"anthropic-version": "2023-06-01", "x-api-key": "k"})
    assert r.status_code == 200 and r.json()["type"] == "message"


@pytest.mark.parametrize(
    "body, status, kind, field",
    [
        ({"model": MODEL, "messages": ASK}, 400, "invalid_request_error", "max_tokens"),
        ({"model": MODEL, "max_tokens": 4}, 400, "invalid_request_error", "messages"),
        (
            {
                "model": MODEL,
                "max_tokens": 4,
                "messages": [{"role": "user", "content": [{"type": "video"}]}],
            },
            400,
            "invalid_request_error",
            "messages[0].content[0].type",
        ),
        (
            {
                "model": MODEL,
                "max_tokens": 4,
                "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}],
            },
            400,
            "invalid_request_error",
            "messages[0].content[0].type",
        ),
        (
            {
                "model": MODEL,
                "max_tokens": 4,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "tool_result", "tool_use_id": "toolu_x", "content": "1"}
                        ],
                    }
                ],
            },
            400,
            "invalid_request_error",
            "messages[0].content[0].tool_use_id",
        ),
        (
            {"model": MODEL, "max_tokens": "4", "messages": ASK},
            400,
            "invalid_request_error",
            "max_tokens",
        ),
        (
            {"model": MODEL, "max_tokens": 4, "messages": ASK, "temperature": 1.5},
            400,
            "invalid_request_error",
            "temperature",
        ),
        (
            {"model": MODEL, "max_tokens": 4, "messages": ASK, "service_tier": "gold"},
            400,
            "invalid_request_error",
            "service_tier",
        ),
        (
            {"model": MODEL, "max_tokens": 4, "messages": ASK, "tool_choice": {"type": "any"}},
            400,
            "invalid_request_error",
            "tool_choice",
        ),
        (
            {
                "model": MODEL,
                "max_tokens": 4,
                "messages": ASK,
                "tools": [{"name": "bad name", "input_schema": {}}],
            },
            400,
            "invalid_request_error",
            "tools[0].name",
        ),
        (
            {"model": MODEL, "max_tokens": 4, "messages": ASK, "bogus": 1},
            400,
            "invalid_request_error",
            "bogus",
        ),
        ({"model": "nope", "max_tokens": 4, "messages": ASK}, 404, "not_found_error", "model"),
    ],
)
def test_refusals_in_anthropic_shape_name_the_field(srv, body, status, kind, field):
    got_status, got_kind, message = error_of(post(srv, "/v1/messages", body))
    assert (got_status, got_kind) == (status, kind)
    assert field in message


def test_sdk_raises_typed_errors(client):
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="nope", max_tokens=4, messages=ASK)
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model=MODEL, max_tokens=0, messages=ASK)
    assert "max_tokens" in str(info.value)
