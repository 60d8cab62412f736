"""The agent path (issue 29, items 1-4) against the real server on the demo model, through the
official `openai` client and raw HTTP: a response_format kept beside tools (calls OR schema
JSON), impossible schemas refused with the keyword's path, an answer cut by max_tokens never
leaking call markup nor listing a cut call, and the per-turn call cap."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from ultrafast_harness.bench.server_process import ServerProcess

LOOKUP = {
    "type": "object",
    "properties": {"q": {"type": "string", "maxLength": 20}},
    "required": ["q"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": LOOKUP}}]
FLAT_TOOLS = [{"type": "function", "name": "lookup", "parameters": LOOKUP}]
ANSWER = {
    "type": "object",
    "properties": {"answer": {"type": "string", "maxLength": 40}},
    "required": ["answer"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "answer"}]
MARKUP = ("<tool", "</to", "<tool_call>", "tool_call>")
MAX_CALLS = 2


@pytest.fixture(scope="module")
def srv():
    server = ServerProcess(
        "--priority-ttft-ms",
        "10000",
        "--max-tool-calls",
        str(MAX_CALLS),
        num_slots=4,
        max_model_len=1024,
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


def schema_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "a", "strict": True, "schema": schema}}


def calls_or_answer(calls, content, finish):
    """The reply is tool calls with valid arguments, or JSON valid under ANSWER."""
    if calls:
        assert finish == "tool_calls"
        for name, arguments in calls:
            assert name == "lookup"
            jsonschema.validate(json.loads(arguments), LOOKUP)
        return "calls"
    assert finish == "stop", content
    jsonschema.validate(json.loads(content), ANSWER)
    return "answer"


# ---- 1. response_format with tools ---------------------------------------------------------


@pytest.mark.parametrize("choice", [None, "auto"])
def test_chat_tools_and_schema_give_calls_or_schema_json(client, choice):
    seen = set()
    for seed in range(4):
        extra = {} if choice is None else {"tool_choice": choice}
        r = client.chat.completions.create(
            model="demo-code",
            messages=ASK,
            tools=TOOLS,
            response_format=schema_format(ANSWER),
            max_tokens=200,
            temperature=1,
            seed=seed,
            **extra,
        )
        c = r.choices[0]
        calls = [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []]
        seen.add(calls_or_answer(calls, c.message.content, c.finish_reason))
    assert seen  # each reply checked above


def test_chat_tools_and_schema_streamed(client):
    for seed in range(3):
        stream = client.chat.completions.create(
            model="demo-code",
            messages=ASK,
            tools=TOOLS,
            response_format=schema_format(ANSWER),
            max_tokens=200,
            temperature=1,
            seed=seed,
            stream=True,
        )
        content, args, names, finish = "", {}, {}, None
        for chunk in stream:
            delta = chunk.choices[0].delta
            content += delta.content or ""
            for t in delta.tool_calls or []:
                if t.function.name:
                    names[t.index] = t.function.name
                args[t.index] = args.get(t.index, "") + (t.function.arguments or "")
            finish = chunk.choices[0].finish_reason or finish
        calls = [(names[i], args[i]) for i in sorted(names)]
        calls_or_answer(calls, content, finish)


@pytest.mark.parametrize("stream", [False, True])
def test_responses_tools_and_text_format_give_calls_or_schema_json(srv, stream):
    for _ in range(3):  # the Responses API has no seed: sampled answers differ by run
        body = {
            "model": "demo-code",
            "input": "answer",
            "tools": FLAT_TOOLS,
            "text": {"format": {"type": "json_schema", "name": "a", "schema": ANSWER}},
            "max_output_tokens": 200,
            "temperature": 1,
            "store": False,
            "stream": stream,
        }
        r = httpx.post(srv.url + "/v1/responses", json=body, timeout=120)
        assert r.status_code == 200, r.text
        if stream:
            done = [
                json.loads(line[6:])
                for line in r.text.splitlines()
                if line.startswith("data: ") and '"response.completed"' in line
            ]
            assert done, r.text[-500:]
            out = done[-1]["response"]
        else:
            out = r.json()
        calls = [(i["name"], i["arguments"]) for i in out["output"] if i["type"] == "function_call"]
        texts = [
            p["text"]
            for i in out["output"]
            if i["type"] == "message"
            for p in i["content"]
            if p["type"] == "output_text"
        ]
        calls_or_answer(calls, "".join(texts), "tool_calls" if calls else "stop")
        assert out["status"] == "completed"


# ---- 2. schemas no answer can satisfy --------------------------------------------------------

IMPOSSIBLE = {
    "type": "object",
    "properties": {"zip": {"type": "string", "pattern": "^(a{999}){999}$"}},
    "required": ["zip"],
    "additionalProperties": False,
}


def test_chat_pattern_longer_than_the_budget_is_400_naming_it(srv):
    body = {"messages": ASK, "response_format": schema_format(IMPOSSIBLE), "max_tokens": 200}
    r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "response_format.json_schema.schema.properties.zip.pattern"


def test_responses_pattern_longer_than_the_budget_is_400_naming_it(srv):
    body = {
        "input": "answer",
        "text": {"format": {"type": "json_schema", "name": "a", "schema": IMPOSSIBLE}},
        "max_output_tokens": 200,
        "store": False,
    }
    r = httpx.post(srv.url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "text.format.schema.properties.zip.pattern"


@pytest.mark.parametrize(
    ("schema", "param"),
    [
        ({"type": "integer", "minimum": 5, "maximum": 4}, "minimum"),
        ({"type": "string", "minLength": 5, "maxLength": 4}, "minLength"),
        ({"type": "string", "enum": [1, 2]}, "enum"),
        ({"type": "string", "pattern": "^[0-9]{6}$", "maxLength": 5}, "pattern"),
    ],
)
def test_empty_language_is_400_naming_the_keyword(srv, schema, param):
    wrapped = {
        "type": "object",
        "properties": {"v": schema},
        "required": ["v"],
        "additionalProperties": False,
    }
    body = {"messages": ASK, "response_format": schema_format(wrapped), "max_tokens": 50}
    r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == f"response_format.json_schema.schema.properties.v.{param}"


# ---- 3. bounds JSON itself has ---------------------------------------------------------------


def test_max_properties_is_enforced(client):
    digit = {"type": "integer", "minimum": 0, "maximum": 9}
    schema = {
        "type": "object",
        "properties": {"a": digit, "b": digit, "c": digit, "d": digit},
        "additionalProperties": False,
        "minProperties": 1,
        "maxProperties": 2,
    }
    for seed in range(3):
        r = client.chat.completions.create(
            model="demo-code",
            messages=ASK,
            response_format=schema_format(schema),
            max_tokens=100,
            temperature=1,
            seed=seed,
        )
        c = r.choices[0]
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), schema)


# ---- 4. cut calls, markup, the call cap ------------------------------------------------------


def test_cut_call_leaks_no_markup_and_is_not_listed(client):
    for max_tokens in (1, 2, 3, 4, 6, 9, 14, 20):
        r = client.chat.completions.create(
            model="demo-code",
            messages=ASK,
            tools=TOOLS,
            tool_choice="required",
            max_tokens=max_tokens,
            temperature=0,
        )
        c = r.choices[0]
        content = c.message.content or ""
        assert not any(m in content for m in MARKUP), (max_tokens, content)
        for call in c.message.tool_calls or []:
            jsonschema.validate(json.loads(call.function.arguments), LOOKUP)
        assert c.finish_reason == "length", max_tokens


def test_streamed_cut_call_ends_with_length_and_no_markup(client):
    for max_tokens in (2, 9, 14):
        stream = client.chat.completions.create(
            model="demo-code",
            messages=ASK,
            tools=TOOLS,
            tool_choice="required",
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
        )
        content, finish = "", None
        for chunk in stream:
            content += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        assert not any(m in content for m in MARKUP), content
        assert finish == "length"


def test_parallel_calls_stop_at_the_cap(client):
    r = client.chat.completions.create(
        model="demo-code",
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=300,
        temperature=0,
    )
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    assert 1 <= len(c.message.tool_calls) <= MAX_CALLS
