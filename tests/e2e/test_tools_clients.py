"""Tool calling against the real server (demo model, grammar-constrained), driven by the
official `openai` client, raw HTTP, the WebSocket and the OpenAI Agents SDK. A model this
small chooses tools poorly: the tests check plumbing and grammar (listed tools only,
arguments valid under their schema, one call when one is allowed), not the model's choice."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest
from websockets.sync.client import connect

from ultrafast_harness.bench.server_process import ServerProcess

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["c", "f"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
CLOCK = {
    "type": "object",
    "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
    "required": ["zone"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
TOOLS = [{"type": "function", "function": {"name": n, "parameters": s}} for n, s in SCHEMAS.items()]
FLAT_TOOLS = [{"type": "function", "name": n, "parameters": s} for n, s in SCHEMAS.items()]
ASK = [{"role": "user", "content": "Weather and time in Paris?"}]


@pytest.fixture(scope="module")
def srv():
    server = ServerProcess("--priority-ttft-ms", "10000", num_slots=4, max_model_len=1024)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


def valid(name: str, arguments: str) -> dict:
    args = json.loads(arguments)
    jsonschema.validate(args, SCHEMAS[name])
    return args


def chat(client, **fields):
    fields.setdefault("max_tokens", 120)
    return client.chat.completions.create(model="demo-code", messages=ASK, tools=TOOLS, **fields)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_one_allowed_call_is_schema_valid_and_ends_the_turn(client, temperature):
    r = chat(client, tool_choice="required", parallel_tool_calls=False, temperature=temperature)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    valid(call.function.name, call.function.arguments)


def test_named_function_is_the_one_called(client):
    r = chat(client, tool_choice={"type": "function", "function": {"name": "get_time"}})
    (call,) = r.choices[0].message.tool_calls
    assert (
        call.function.name == "get_time"
        and -12 <= valid("get_time", call.function.arguments)["zone"] <= 14
    )


def test_required_parallel_calls_each_valid(client):
    r = chat(client, tool_choice="required", temperature=0)
    calls = r.choices[0].message.tool_calls
    assert calls
    for call in calls:
        if r.choices[0].finish_reason == "length" and call is calls[-1]:
            continue  # the output cap may cut the last call
        valid(call.function.name, call.function.arguments)


def test_none_calls_nothing(client):
    r = chat(client, tool_choice="none", temperature=0, max_tokens=16)
    assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason in ("stop", "length")


def test_streamed_deltas_assemble_to_the_non_streamed_call(client):
    fields = {"tool_choice": "required", "parallel_tool_calls": False, "temperature": 0}
    full = chat(client, **fields).choices[0].message.tool_calls[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in chat(client, stream=True, **fields):
        for tc in chunk.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"id": tc.id, "name": None, "arguments": ""})
            if tc.function.name:
                assert entry["name"] is None, "the name comes once, first"
                entry["name"] = tc.function.name
            entry["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and list(calls) == [0]
    assert (calls[0]["name"], calls[0]["arguments"]) == (
        full.function.name,
        full.function.arguments,
    )


def test_opt_in_done_event_comes_before_the_end(srv):
    body = {
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": "required",
        "max_tokens": 120,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_tool_call_done": True},
    }
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    done_at = [i for i, line in enumerate(lines) if line == "event: tool_call.done"]
    assert done_at and lines[-1] == "data: [DONE]"
    first = json.loads(lines[done_at[0] + 1][6:])
    assert first["choice_index"] == 0 and first["tool_call"]["index"] == 0
    valid(first["tool_call"]["function"]["name"], first["tool_call"]["function"]["arguments"])
    finish_at = next(i for i, line in enumerate(lines) if '"finish_reason":"' in line)
    assert done_at[0] < finish_at


def test_history_with_calls_and_results_is_served(client):
    r = chat(client, tool_choice="required", parallel_tool_calls=False, temperature=0)
    call = r.choices[0].message.tool_calls[0]
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    again = client.chat.completions.create(
        model="demo-code", messages=messages, tools=TOOLS, tool_choice="none", max_tokens=8
    )
    assert again.choices[0].finish_reason in ("stop", "length")


def test_responses_function_calls_round_trip_through_the_store(client):
    conv = client.conversations.create()
    first = client.responses.create(
        model="demo-code",
        input="Weather in Paris?",
        tools=FLAT_TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        conversation=conv.id,
        max_output_tokens=120,
    )
    assert first.status == "completed"
    (call,) = [item for item in first.output if item.type == "function_call"]
    valid(call.name, call.arguments)
    second = client.responses.create(
        model="demo-code",
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        tools=FLAT_TOOLS,
        tool_choice="none",
        conversation=conv.id,
        max_output_tokens=8,
    )
    assert [item.type for item in second.output] == ["message"]
    items = client.conversations.items.list(conv.id, order="asc").data
    kinds = [item.type for item in items]
    assert kinds[:3] == ["message", "function_call", "function_call_output"]
    assert items[1].call_id == items[2].call_id == call.call_id


def test_responses_stream_sends_each_call_done_before_completed(client):
    events = list(
        client.responses.create(
            model="demo-code",
            input="Weather and time in Paris?",
            tools=FLAT_TOOLS,
            tool_choice="required",
            max_output_tokens=120,
            temperature=0,
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    done = [
        i
        for i, e in enumerate(events)
        if e.type == "response.output_item.done" and e.item.type == "function_call"
    ]
    assert done and kinds[-1] in ("response.completed", "response.incomplete")
    final = events[-1].response
    calls = [item for item in final.output if item.type == "function_call"]
    # the final response lists whole calls only; a call cut by max_output_tokens was streamed
    # (its item done with status incomplete) and the response is `incomplete`
    whole = [i for i in done if events[i].item.status == "completed"]
    assert [events[i].item.call_id for i in whole] == [c.call_id for c in calls]
    assert len(whole) == len(done) or kinds[-1] == "response.incomplete"
    for i in done:
        item = events[i].item
        if item.status == "completed":
            valid(item.name, item.arguments)


def test_realtime_function_call_events_and_result_item(srv):
    ws_url = srv.url.replace("http://", "ws://") + "/v1/realtime"
    with connect(ws_url) as ws:
        assert json.loads(ws.recv(timeout=30))["type"] == "session.created"

        def send(event):
            ws.send(json.dumps(event))

        def until(kind):
            seen = []
            while True:
                event = json.loads(ws.recv(timeout=60))
                seen.append(event)
                if event["type"] in (kind, "error"):
                    return seen

        send(
            {
                "type": "session.update",
                "session": {
                    "tools": FLAT_TOOLS,
                    "tool_choice": "required",
                    "parallel_tool_calls": False,
                },
            }
        )
        assert until("session.updated")[-1]["type"] == "session.updated"
        send({"type": "conversation.item.create", "item": {"role": "user", "content": "Weather?"}})
        until("conversation.item.created")
        send({"type": "response.create", "response": {"max_output_tokens": 120}})
        events = until("response.done")
        kinds = [e["type"] for e in events]
        args_done = kinds.index("response.function_call_arguments.done")
        assert args_done < kinds.index("response.done")
        call = events[args_done]
        deltas = "".join(
            e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"
        )
        assert deltas == call["arguments"]
        valid(call["name"], call["arguments"])
        assert events[-1]["response"]["status"] == "completed"
        send(
            {
                "type": "conversation.item.create",
                "item": {
                    "type": "function_call_output",
                    "call_id": call["call_id"],
                    "output": "sunny",
                },
            }
        )
        created = until("conversation.item.created")[-1]
        assert created["item"]["type"] == "function_call_output"
        assert created["item"]["call_id"] == call["call_id"]


def test_openai_agents_sdk_completes_a_tool_loop(srv):
    agents = pytest.importorskip("agents")
    calls: list[tuple[str, dict]] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Current weather of a city."""
        calls.append(("get_weather", {"city": city}))
        return "sunny, 21 C"

    @agents.function_tool
    def get_time(zone: int) -> str:
        """Local time in a UTC offset."""
        calls.append(("get_time", {"zone": zone}))
        return "12:00"

    agents.set_tracing_disabled(True)
    model = agents.OpenAIChatCompletionsModel(
        model="demo-code",
        openai_client=openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0),
    )
    agent = agents.Agent(
        name="assistant",
        instructions="Use the tools, then answer.",
        tools=[get_weather, get_time],
        model=model,
        model_settings=agents.ModelSettings(
            tool_choice="required", parallel_tool_calls=False, max_tokens=60, temperature=0
        ),
    )
    result = asyncio.run(agents.Runner.run(agent, "Weather in Paris?", max_turns=4))
    # the loop: a forced call, its result back to the model (tool_choice then resets to
    # auto, the SDK's default), and a final answer as text
    assert len(calls) >= 1 and calls[0][0] in ("get_weather", "get_time")
    kinds = [item.type for item in result.new_items]
    assert kinds[0] == "tool_call_item" and kinds[1] == "tool_call_output_item"
    assert kinds[-1] == "message_output_item" and isinstance(result.final_output, str)


@pytest.mark.real_model
def test_smollm2_calls_a_listed_tool_with_valid_arguments_and_stops_at_the_brace():
    from tests.model.gguf_files import require_smollm2

    server = ServerProcess(
        "--priority-ttft-ms", "10000", model=require_smollm2(), num_slots=2, max_model_len=2048
    )
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        results = {}
        name = client.models.list().data[0].id
        for parallel in (True, False):
            r = client.chat.completions.create(
                model=name,
                messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                tools=TOOLS,
                tool_choice="required",
                parallel_tool_calls=parallel,
                temperature=0,
                max_tokens=100,
            )
            choice = r.choices[0]
            assert choice.finish_reason == "tool_calls"
            for call in choice.message.tool_calls:
                valid(call.function.name, call.function.arguments)
            results[parallel] = (choice.message.tool_calls[0], r.usage.completion_tokens)
        (free, free_tokens), (single, single_tokens) = results[True], results[False]
        assert (free.function.name, free.function.arguments) == (
            single.function.name,
            single.function.arguments,
        )  # greedy: the same first call
        assert single_tokens < free_tokens  # no closing tag, no end token: ends at the brace
    finally:
        server.stop()
