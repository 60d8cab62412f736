"""Tool calls whose trigger is one special token, through the HTTP server and the real engine:
the demo model's weights behind a vocabulary where Mistral's `[TOOL_CALLS]` is a special token
and a Mistral-style chat template. Forced calls start with that token; an auto call the model
opens with it natively (steered here with logit_bias, since a demo model never would) is a
tool call; streamed deltas equal the non-streamed answer."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.special_token_model import TRIGGER, make_model_dir
from ultrafast_harness.bench.server_process import ServerProcess

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}},
    },
]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def trigger_and_url(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("mistral-demo")
    trigger_id = make_model_dir(model_dir)
    server = ServerProcess("--priority-ttft-ms", "10000", model=model_dir, max_model_len=1024)
    yield trigger_id, server.url
    server.stop()


@pytest.fixture(scope="module")
def client(trigger_and_url):
    return openai.OpenAI(base_url=trigger_and_url[1] + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def trigger_id(trigger_and_url):
    return trigger_and_url[0]


def chat(client, **fields):
    fields.setdefault("max_tokens", 80)
    fields.setdefault("temperature", 0.0)
    return client.chat.completions.create(
        model=client.models.list().data[0].id, messages=ASK, tools=TOOLS, **fields
    )


def checked_call(choice) -> tuple[str, dict]:
    assert choice.finish_reason == "tool_calls"
    assert not choice.message.content  # the trigger is never content
    (call,) = choice.message.tool_calls
    args = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        jsonschema.validate(args, WEATHER)
    return call.function.name, args


@pytest.mark.parametrize(
    "choice",
    ["required", {"type": "function", "function": {"name": "ping"}}],
    ids=["required", "named"],
)
def test_forced_call_opens_with_the_special_token(client, choice):
    r = chat(client, tool_choice=choice, parallel_tool_calls=False, logprobs=True)
    name, _ = checked_call(r.choices[0])
    assert name == "ping" or choice == "required"
    first = r.choices[0].logprobs.content[0]
    assert first.token == TRIGGER  # one token, not the text spelled out


def test_auto_call_opened_by_the_native_token_is_a_tool_call(client, trigger_id):
    r = chat(
        client,
        tool_choice="auto",
        parallel_tool_calls=False,
        logit_bias={str(trigger_id): 100},
        logprobs=True,
    )
    checked_call(r.choices[0])
    assert r.choices[0].logprobs.content[0].token == TRIGGER


def test_streamed_call_equals_the_non_streamed_one(client, trigger_id):
    fields = {
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "logit_bias": {str(trigger_id): 100},
    }
    body = chat(client, **fields).choices[0]
    content, calls, finish = "", {}, None
    for chunk in chat(client, stream=True, **fields):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for tc in choice.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                entry["name"] += tc.function.name or ""
                entry["arguments"] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == body.finish_reason == "tool_calls"
    assert content == (body.message.content or "")
    expected = [
        {"name": c.function.name, "arguments": c.function.arguments}
        for c in body.message.tool_calls
    ]
    assert [calls[i] for i in sorted(calls)] == expected


def test_responses_api_call_and_the_history_it_leaves(client):
    """The Responses API: a call opened by the token becomes a function_call item; sent back
    with its result, the history renders the trigger again and the next turn is served."""
    model = client.models.list().data[0].id
    flat = [{"type": "function", **t["function"]} for t in TOOLS]
    first = client.responses.create(
        model=model,
        input="Weather in Paris?",
        tools=flat,
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=80,
        temperature=0.0,
    )
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert not [item for item in first.output if item.type == "message"]
    chat_history = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"},
    ]
    again = client.chat.completions.create(
        model=model, messages=chat_history, tools=TOOLS, tool_choice="none", max_tokens=8
    )
    assert again.choices[0].finish_reason in ("stop", "length")
    assert TRIGGER not in (again.choices[0].message.content or "")
