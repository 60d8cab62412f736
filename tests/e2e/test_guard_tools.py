"""The output guard screens tool-call arguments as it screens content: a call whose arguments
match a pattern is cut (finish_reason content_filter), and no byte of the match is sent."""

from __future__ import annotations

import json

import httpx
import pytest

from ultrafast_harness.bench.server_process import ServerProcess

SECRET = "zebra-secret-42"  # the grammar forces it into the arguments: no luck involved


def tool(name: str, value: str) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "parameters": {
                "type": "object",
                "properties": {"key": {"type": "string", "enum": [value]}},
                "required": ["key"],
                "additionalProperties": False,
            },
        },
    }


TOOLS = [tool("lookup", SECRET), tool("safe", "plain-value")]


def body(name: str, stream: bool) -> dict:
    return {
        "messages": [{"role": "user", "content": "look it up"}],
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": name}},
        "max_tokens": 64,
        "temperature": 0,
        "stream": stream,
    }


@pytest.fixture(scope="module")
def guarded():
    srv = ServerProcess(
        "--guard-pattern",
        "zebra-secret",
        "--guard-hold-back-tokens",
        "4",
        "--priority-ttft-ms",
        "10000",
    )
    yield srv
    srv.stop()


def stream_chunks(url: str, payload: dict) -> list[dict]:
    chunks = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=payload, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def test_a_call_whose_arguments_match_is_cut_streaming_and_not(guarded):
    chunks = stream_chunks(guarded.url, body("lookup", stream=True))
    assert "zebra" not in json.dumps(chunks)
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "content_filter" and finishes.count("content_filter") == 1
    r = httpx.post(guarded.url + "/v1/chat/completions", json=body("lookup", False), timeout=60)
    assert r.status_code == 200 and "zebra" not in r.text
    assert r.json()["choices"][0]["finish_reason"] == "content_filter"


def test_a_call_the_guard_does_not_match_goes_out_whole(guarded):
    r = httpx.post(guarded.url + "/v1/chat/completions", json=body("safe", False), timeout=60)
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "safe"
    assert json.loads(call["function"]["arguments"]) == {"key": "plain-value"}
    chunks = stream_chunks(guarded.url, body("safe", stream=True))
    deltas = [
        d
        for c in chunks
        if c["choices"]
        for d in (c["choices"][0]["delta"].get("tool_calls") or [])
    ]
    assert deltas[0]["function"]["name"] == "safe"
    assert (
        "".join(d["function"].get("arguments", "") for d in deltas) == call["function"]["arguments"]
    )
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
