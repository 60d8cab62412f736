"""The last gaps of issue 29 against the real server on the demo model, through the official
`openai` client and raw HTTP: a client `stop` string that cuts a constrained answer ends
`length` (never `stop` with invalid JSON), streamed and not, a tool call too; the Responses
API's `max_tool_calls` (honoured, checked, echoed); a tool whose parameters no arguments can
match is a 400 naming the keyword's exact path."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.e2e.test_agent_path import ANSWER, ASK, FLAT_TOOLS, TOOLS
from ultrafast_harness.bench.server_process import ServerProcess

FORMAT = {"type": "json_schema", "json_schema": {"name": "a", "strict": True, "schema": ANSWER}}
MAX_CALLS = 3  # the server's --max-tool-calls
# the grammar makes every answer begin `{"answer":"`: this stop string always cuts it there
CUT = '":"'


@pytest.fixture(scope="module")
def srv():
    server = ServerProcess(
        "--priority-ttft-ms", "10000", "--max-tool-calls", str(MAX_CALLS), max_model_len=1024
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


def post(srv, path: str, body: dict) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, timeout=120)


# ---- a stop string inside a constrained answer ------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_stop_inside_the_schema_answer_ends_length(client, stream):
    args = {"messages": ASK, "response_format": FORMAT, "stop": [CUT], "max_tokens": 64}
    if not stream:
        c = client.chat.completions.create(model="demo-code", temperature=0, **args).choices[0]
        assert (c.finish_reason, c.message.content) == ("length", '{"answer')
        return
    content, finish = "", None
    for chunk in client.chat.completions.create(
        model="demo-code", temperature=0, stream=True, **args
    ):
        content += chunk.choices[0].delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
    assert (finish, content) == ("length", '{"answer')


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_stop_inside_a_tool_call_is_a_cut_call(client, stream):
    args = {
        "model": "demo-code",
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": "required",
        "stop": ['"q"'],  # inside the first call's arguments
        "max_tokens": 64,
        "temperature": 0,
    }
    if not stream:
        c = client.chat.completions.create(**args).choices[0]
        assert c.finish_reason == "length"
        assert not c.message.tool_calls and "<" not in (c.message.content or "")
        return
    content, finish, calls = "", None, 0
    for chunk in client.chat.completions.create(**args, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        calls += sum(1 for t in delta.tool_calls or [] if t.id)
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "length" and "<" not in content and calls <= 1


# ---- the Responses API's max_tool_calls -------------------------------------------------------


def responses_calls(srv, stream: bool, **fields) -> tuple[dict, list[dict]]:
    body = {
        "model": "demo-code",
        "input": "answer",
        "tools": FLAT_TOOLS,
        "tool_choice": "required",
        "max_output_tokens": 300,
        "temperature": 0,
        "store": False,
        "stream": stream,
        **fields,
    }
    r = post(srv, "/v1/responses", body)
    assert r.status_code == 200, r.text
    if stream:
        last = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: ")][-1]
        out = last["response"]
    else:
        out = r.json()
    return out, [i for i in out["output"] if i["type"] == "function_call"]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_max_tool_calls_caps_the_calls_and_is_echoed(srv, stream):
    out, calls = responses_calls(srv, stream)
    assert out["max_tool_calls"] is None and 2 <= len(calls) <= MAX_CALLS  # the flag's cap
    out, calls = responses_calls(srv, stream, max_tool_calls=1)
    assert out["max_tool_calls"] == 1 and len(calls) == 1
    assert out["status"] == "completed" and json.loads(calls[0]["arguments"])["q"] is not None
    out, calls = responses_calls(srv, stream, max_tool_calls=MAX_CALLS + 5)  # the flag wins
    assert out["max_tool_calls"] == MAX_CALLS + 5 and len(calls) <= MAX_CALLS


def test_max_tool_calls_zero_makes_no_call(srv):
    out, calls = responses_calls(srv, False, tool_choice="auto", max_tool_calls=0)
    assert out["max_tool_calls"] == 0 and not calls
    texts = [p["text"] for i in out["output"] if i["type"] == "message" for p in i["content"]]
    assert "<tool_call>" not in "".join(texts)


@pytest.mark.parametrize("value", [-1, "2", 1.5, None, {}])
def test_a_bad_max_tool_calls_is_a_400_naming_it(srv, value):
    body = {"model": "demo-code", "input": "x", "tools": FLAT_TOOLS, "max_tool_calls": value}
    if value is None:  # null is the default: accepted
        body["max_output_tokens"] = 4
        assert post(srv, "/v1/responses", body).status_code == 200
        return
    r = post(srv, "/v1/responses", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tool_calls", r.text


def test_max_tool_calls_zero_with_a_required_call_is_a_400(srv):
    body = {
        "model": "demo-code",
        "input": "x",
        "tools": FLAT_TOOLS,
        "tool_choice": "required",
        "max_tool_calls": 0,
    }
    r = post(srv, "/v1/responses", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tool_calls", r.text


# ---- a tool no arguments can match ------------------------------------------------------------

EMPTY = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 4}}}


def test_a_chat_tool_no_arguments_can_match_names_its_keyword(srv):
    tools = [TOOLS[0], {"type": "function", "function": {"name": "count", "parameters": EMPTY}}]
    body = {"model": "demo-code", "messages": ASK, "tools": tools, "max_tokens": 8}
    r = post(srv, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "tools[1].function.parameters.properties.n.minimum"


def test_a_responses_tool_no_arguments_can_match_names_its_keyword(srv):
    tools = [FLAT_TOOLS[0], {"type": "function", "name": "count", "parameters": EMPTY}]
    body = {"model": "demo-code", "input": "x", "tools": tools, "max_output_tokens": 8}
    r = post(srv, "/v1/responses", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "tools[1].parameters.properties.n.minimum"
