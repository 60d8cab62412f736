"""Ollama's API on the real server (demo model), through the official `ollama` client and raw
HTTP: chat, streaming, generate, list, show, ps, version, structured `format`, tools, the
measured timings, `GET /` negotiation, and refusals in Ollama's error shape."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from ultrafast_harness.bench.server_process import ServerProcess

ollama = pytest.importorskip("ollama", reason="the ollama client is in the test extras")

NAME = "demo-code:latest"  # as Ollama clients write it; the server serves `demo-code`
ASK = [{"role": "user", "content": "def add(a, b):"}]
GREEDY = {"temperature": 0, "num_predict": 8}
POINT = {
    "type": "object",
    "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
    "required": ["x", "y"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def srv():
    server = ServerProcess("--priority-ttft-ms", "10000", max_model_len=1024)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(srv):
    return ollama.Client(host=srv.url)


def test_chat_and_its_measured_timings(client):
    r = client.chat(model=NAME, messages=ASK, options=GREEDY, stream=False)
    assert r.done and r.done_reason in ("stop", "length") and r.message.role == "assistant"
    assert r.message.content
    assert 1 <= r.eval_count <= 8 and r.prompt_eval_count >= 1
    parts = r.load_duration + r.prompt_eval_duration + r.eval_duration
    assert 0 < parts <= r.total_duration
    assert r.eval_duration > 0 and r.prompt_eval_duration > 0
    again = client.chat(model=NAME, messages=ASK, options=GREEDY, stream=False)
    assert again.message.content == r.message.content  # greedy
    assert again.prompt_eval_count < r.prompt_eval_count  # the prefix cache held the prompt


def test_chat_stream_equals_the_whole_answer(client):
    whole = client.chat(model="demo-code", messages=ASK, options=GREEDY, stream=False)
    pieces = list(client.chat(model=NAME, messages=ASK, options=GREEDY, stream=True))
    assert all(not p.done for p in pieces[:-1]) and pieces[-1].done
    assert "".join(p.message.content for p in pieces) == whole.message.content
    assert pieces[-1].eval_count == whole.eval_count and pieces[-1].done_reason


def test_generate_stream_and_whole(client):
    whole = client.generate(model=NAME, prompt="def add(a, b):", options=GREEDY, stream=False)
    assert whole.done and whole.response and whole.eval_count >= 1
    assert whole.context and len(whole.context) > whole.eval_count
    pieces = list(client.generate(model=NAME, prompt="def add(a, b):", options=GREEDY, stream=True))
    assert "".join(p.response for p in pieces) == whole.response
    raw = client.generate(model=NAME, prompt="def add(a, b):", options=GREEDY, raw=True)
    # no template around a raw prompt: a shorter prompt (`context` is prompt + answer ids)
    assert raw.response
    assert len(raw.context) - raw.eval_count < len(whole.context) - whole.eval_count


def test_structured_format_json_schema_and_json(client):
    r = client.chat(
        model=NAME, messages=ASK, format=POINT, options={"temperature": 0, "num_predict": 60}
    )
    jsonschema.validate(json.loads(r.message.content), POINT)
    g = client.generate(
        model=NAME, prompt="A point:", format="json", options={"temperature": 0, "num_predict": 60}
    )
    assert isinstance(json.loads(g.response), dict)


def test_tools_reach_the_prompt_and_calls_round_trip(client):
    tools = [
        {
            "type": "function",
            "function": {"name": "move", "description": "Move to a point", "parameters": POINT},
        }
    ]
    ask = [{"role": "user", "content": "# go\ndef move_to(p):"}]
    plain = client.chat(model=NAME, messages=ask, options=GREEDY)
    r = client.chat(
        model=NAME, messages=ask, tools=tools, options={"temperature": 0, "num_predict": 80}
    )
    assert r.prompt_eval_count > plain.prompt_eval_count  # the tools are listed in the prompt
    for call in r.message.tool_calls or []:  # the model may answer in text; a call is valid
        assert call.function.name == "move"
        jsonschema.validate(dict(call.function.arguments), POINT)
    called = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"function": {"name": "move", "arguments": {"x": 1, "y": 2}}}],
    }
    history = [*ask, called, {"role": "tool", "content": "arrived", "tool_name": "move"}]
    again = client.chat(model=NAME, messages=history, tools=tools, options=GREEDY)
    assert again.done and again.eval_count >= 1


def test_list_show_ps_version(client, srv):
    listed = client.list()
    assert [m.model for m in listed.models] == [NAME]
    assert listed.models[0].size > 0 and listed.models[0].details.format == "gguf"
    shown = client.show(NAME)
    assert "<|im_start|>" in shown.template  # the model's chat template
    assert shown.modelinfo["general.architecture"] == shown.details.family
    running = client.ps()
    assert [m.model for m in running.models] == [NAME] and running.models[0].size > 0
    assert httpx.get(srv.url + "/api/version").json()["version"]


def test_root_negotiates_playground_or_ollama_is_running(srv):
    assert httpx.get(srv.url + "/").text == "Ollama is running"
    assert httpx.head(srv.url + "/").status_code == 200
    page = httpx.get(srv.url + "/", headers={"accept": "text/html,*/*"})
    assert page.headers["content-type"].startswith("text/html")


@pytest.mark.parametrize(
    "path, body, status, field",
    [
        (
            "/api/chat",
            {"model": NAME, "messages": ASK, "options": {"temperature": "hot"}},
            400,
            "options.temperature",
        ),
        (
            "/api/chat",
            {"model": NAME, "messages": ASK, "options": {"num_predict": 1.5}},
            400,
            "options.num_predict",
        ),
        (
            "/api/chat",
            {"model": NAME, "messages": ASK, "options": {"top_k": -1}},
            400,
            "options.top_k",
        ),
        (
            "/api/chat",
            {"model": NAME, "messages": ASK, "options": {"bogus": 1}},
            400,
            "options.bogus",
        ),
        (
            "/api/chat",
            {"model": NAME, "messages": ASK, "options": {"stop": [1]}},
            400,
            "options.stop",
        ),
        ("/api/chat", {"model": NAME, "messages": ASK, "options": []}, 400, "options"),
        (
            "/api/chat",
            {"model": NAME, "messages": [{"role": "user", "content": "x", "images": ["aGk="]}]},
            400,
            "messages[0].images",
        ),
        ("/api/generate", {"model": NAME, "prompt": "x", "images": ["aGk="]}, 400, "images"),
        ("/api/chat", {"model": NAME, "messages": ASK, "format": "yaml"}, 400, "format"),
        ("/api/chat", {"model": NAME, "messages": ASK, "keep_alive": "soon"}, 400, "keep_alive"),
        (
            "/api/chat",
            {"model": NAME, "messages": [{"role": "robot", "content": "x"}]},
            400,
            "messages[0].role",
        ),
        ("/api/chat", {"messages": ASK}, 400, "model"),
        ("/api/chat", {"model": "nope:latest", "messages": ASK}, 404, "nope"),
        ("/api/show", {"model": "nope"}, 404, "nope"),
    ],
)
def test_refusals_in_ollama_shape_name_the_field(srv, path, body, status, field):
    r = httpx.post(srv.url + path, json=body, timeout=60)
    assert r.status_code == status and set(r.json()) == {"error"}, r.text
    assert field in r.json()["error"]


def test_client_raises_response_error(client):
    with pytest.raises(ollama.ResponseError) as info:
        client.chat(model=NAME, messages=ASK, options={"temperature": "hot"})
    assert info.value.status_code == 400 and "options.temperature" in info.value.error


def test_empty_chat_only_loads(srv):
    r = httpx.post(srv.url + "/api/chat", json={"model": NAME, "messages": []}).json()
    assert r["done"] and r["done_reason"] == "load"
