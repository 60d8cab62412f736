"""The OpenAI Agents SDK with a typed final output and two tools (issue 29): the SDK sends
the output type's JSON schema as `response_format` beside the tools; the server keeps it
(calls OR schema JSON), so the agent's loop ends with an answer the SDK parses into the
pydantic model, on the demo model and on SmolLM2. Tool choice is forced where models this
small need it: the first turn must call a tool (they otherwise answer at once), and once a
tool has run the agent's hook sets `tool_choice: none` (on `auto` they call tools again and
again), so the next turn is the schema's JSON."""

from __future__ import annotations

import asyncio
import dataclasses

import openai
import pytest
from pydantic import BaseModel, Field

from ultrafast_harness.bench.server_process import ServerProcess


class Report(BaseModel):
    city: str = Field(max_length=20)
    summary: str = Field(max_length=40)


def run_agent(
    url: str, model_name: str, force_answer: bool, max_turns: int = 8
) -> tuple[object, list[str]]:
    """`force_answer`: `tool_choice: none` once a tool has run; else the SDK's own reset
    to auto after the forced first call."""
    agents = pytest.importorskip("agents")
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Current weather of a city."""
        calls.append("get_weather")
        return "sunny, 21 C"

    @agents.function_tool
    def get_time(zone: int) -> str:
        """Local time in a UTC offset."""
        calls.append("get_time")
        return "12:00"

    class AnswerAfterATool(agents.AgentHooks):
        async def on_tool_end(self, context, agent, tool, result) -> None:
            agent.model_settings = dataclasses.replace(agent.model_settings, tool_choice="none")

    agents.set_tracing_disabled(True)
    model = agents.OpenAIChatCompletionsModel(
        model=model_name,
        openai_client=openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0),
    )
    agent = agents.Agent(
        name="assistant",
        instructions="Use the tools, then answer with a short report.",
        tools=[get_weather, get_time],
        output_type=Report,
        hooks=AnswerAfterATool() if force_answer else None,
        reset_tool_choice=not force_answer,  # else the hook sets it
        model=model,
        model_settings=agents.ModelSettings(
            tool_choice="required", parallel_tool_calls=False, max_tokens=120, temperature=0
        ),
    )
    result = asyncio.run(agents.Runner.run(agent, "Weather in Paris?", max_turns=max_turns))
    return result, calls


def check(result, calls) -> None:
    assert calls and calls[0] in ("get_weather", "get_time")
    kinds = [item.type for item in result.new_items]
    assert kinds[0] == "tool_call_item" and kinds[-1] == "message_output_item"
    assert isinstance(result.final_output, Report)  # the SDK parsed the schema's JSON


def test_agent_with_output_type_and_tools_on_the_demo_model():
    server = ServerProcess("--priority-ttft-ms", "10000", num_slots=2, max_model_len=2048)
    try:
        check(*run_agent(server.url, "demo-code", force_answer=True))
    finally:
        server.stop()


def test_auto_turns_never_give_the_sdk_invalid_json():
    """The SDK's own flow (forced first call, then `auto`): each reply is calls or the
    schema's JSON, so the run ends with a Report or runs out of turns calling tools, never
    `ModelBehaviorError: Invalid JSON` (the response_format had been dropped beside tools)."""
    agents = pytest.importorskip("agents")
    server = ServerProcess("--priority-ttft-ms", "10000", num_slots=2, max_model_len=2048)
    try:
        try:
            result, _ = run_agent(server.url, "demo-code", force_answer=False, max_turns=4)
        except agents.exceptions.MaxTurnsExceeded:
            return
        assert isinstance(result.final_output, Report)
    finally:
        server.stop()


@pytest.mark.real_model
def test_agent_with_output_type_and_tools_on_smollm2():
    from tests.model.gguf_files import require_smollm2

    server = ServerProcess(
        "--priority-ttft-ms", "10000", model=require_smollm2(), num_slots=2, max_model_len=2048
    )
    try:
        name = openai.OpenAI(base_url=server.url + "/v1", api_key="unused").models.list()
        check(*run_agent(server.url, name.data[0].id, force_answer=True))
    finally:
        server.stop()
