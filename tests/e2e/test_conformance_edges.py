"""Client patterns that broke at the API's edges (issue 29, item 5), through the official
`openai` client and raw HTTP against the real server on the demo model: a function without
parameters, `/v1/completions`' default length, a response's own output sent back as input,
an input item whose `type` is not a string, the name on `function_call_arguments.done`, no
`description: null` in `text.format`, and the exact `param` path of schema errors."""

from __future__ import annotations

import json

import httpx
import pytest
from openai import OpenAI

MODEL = "demo-code"
GREEDY = {"temperature": 0}


@pytest.fixture
def client(server):
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def error_of(r: httpx.Response) -> tuple:
    err = r.json()["error"]
    return r.status_code, err["param"]


@pytest.mark.parametrize("declared", [{}, {"parameters": {}}], ids=["absent", "empty"])
def test_a_function_without_parameters_is_called_with_no_arguments(client, declared):
    tool = {"type": "function", "function": {"name": "ping", **declared}}
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "check the service"}],
        tools=[tool],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=64,
        **GREEDY,
    )
    calls = r.choices[0].message.tool_calls
    assert calls and all(json.loads(c.function.arguments) == {} for c in calls)


def test_completions_without_max_tokens_generate_at_most_16_tokens(server):
    body = {"model": MODEL, "prompt": "def f(x):", "seed": 0, **GREEDY}
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200
    body = r.json()
    assert 1 <= body["usage"]["completion_tokens"] <= 16
    if body["usage"]["completion_tokens"] == 16:
        assert body["choices"][0]["finish_reason"] == "length"


def test_a_responses_output_is_accepted_back_as_input(client):
    first = client.responses.create(
        model=MODEL, input="def add(a, b):", max_output_tokens=8, store=False, **GREEDY
    )
    echoed = [item.model_dump(exclude_none=True) for item in first.output]
    assert echoed and echoed[0]["content"][0].keys() >= {"annotations", "logprobs"}
    second = client.responses.create(
        model=MODEL,
        input=[*echoed, {"role": "user", "content": "and now subtract"}],
        max_output_tokens=8,
        store=False,
        **GREEDY,
    )
    assert second.status in ("completed", "incomplete") and second.output


@pytest.mark.parametrize("bad_type", [{}, []], ids=["object", "array"])
def test_an_input_item_type_that_is_not_a_string_is_a_400(server, bad_type):
    r = post(
        server,
        "/v1/responses",
        {"model": MODEL, "input": [{"type": bad_type, "role": "user", "content": "hi"}]},
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith("input[0]")


def test_function_call_arguments_done_carries_the_name(client):
    tools = [{"type": "function", "name": "lookup", "parameters": {"type": "object"}}]
    with client.responses.stream(
        model=MODEL,
        input="look it up",
        tools=tools,
        tool_choice="required",
        max_output_tokens=64,
        store=False,
        **GREEDY,
    ) as stream:
        done = [e for e in stream if e.type == "response.function_call_arguments.done"]
    assert done and all(e.name == "lookup" for e in done)


def test_text_format_description_is_omitted_when_unset(server):
    fmt = {
        "type": "json_schema",
        "name": "answer",
        "strict": True,
        "schema": {
            "type": "object",
            "properties": {"a": {"type": "string", "maxLength": 4}},
            "required": ["a"],
            "additionalProperties": False,
        },
    }
    body = {"model": MODEL, "input": "x", "max_output_tokens": 24, "store": False, **GREEDY}
    r = post(server, "/v1/responses", {**body, "text": {"format": fmt}})
    assert r.status_code == 200, r.text
    echoed = r.json()["text"]["format"]
    assert "description" not in echoed and echoed["name"] == "answer"
    described = {**fmt, "description": "one field"}
    r = post(server, "/v1/responses", {**body, "text": {"format": described}})
    assert r.json()["text"]["format"]["description"] == "one field"


def schema_request(schema: dict) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 8,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "s", "strict": True, "schema": schema},
        },
    }


def test_an_invalid_keyword_is_named_by_its_exact_path(server):
    schema = {"type": "object", "properties": {"zip": {"type": "string", "pattern": 5}}}
    r = post(server, "/v1/chat/completions", schema_request(schema))
    assert error_of(r) == (400, "response_format.json_schema.schema.properties.zip.pattern")


def test_the_nesting_limit_names_the_path_where_it_is_passed(server):
    schema: dict = {"type": "string"}
    for _ in range(70):
        schema = {"type": "object", "properties": {"a": schema}}
    r = post(server, "/v1/chat/completions", schema_request(schema))
    status, param = error_of(r)
    assert status == 400
    assert param.startswith("response_format.json_schema.schema.properties.a.properties.a")
    # the body's 64-level limit is passed at the 31st nested schema's `properties`
    assert param.count(".properties.a") == 30 and param.endswith(".properties")
