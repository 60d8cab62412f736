"""Function calling on the Realtime WebSocket: tools from `session.update` or
`response.create`, `function_call` / `function_call_output` conversation items, and the
call events (`response.output_item.added`, `response.function_call_arguments.delta`,
`response.function_call_arguments.done` the moment a call's JSON closes, then
`response.output_item.done`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ultrafast.server.protocol import Limits
from ultrafast.server.protocol_models import validate_input
from ultrafast.server.sessions.store import Turn
from ultrafast.server.tools.parse import CallArgs, CallDone, CallStart
from ultrafast.server.tools.plan import ToolPlan
from ultrafast.server.tools.responses_api import (
    FunctionCallItem,
    FunctionCallOutputItem,
    call_item,
    plan_from_responses,
)

TOOL_OPTIONS = ("tools", "tool_choice", "parallel_tool_calls")


@dataclass
class _ToolOptions:
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None


def realtime_plan(session: dict, response: dict, limits: Limits) -> ToolPlan | None:
    """`response.create`'s tool options over the session's (`session.update`)."""
    merged = {k: response.get(k, session.get(k)) for k in TOOL_OPTIONS}
    return plan_from_responses(_ToolOptions(**merged), limits)


def function_item_turn(item: Any, turn_id: str) -> Turn | None:
    """A function_call / function_call_output conversation item as a turn; None for other
    item types (messages keep their own path)."""
    kind = item.get("type") if isinstance(item, dict) else None
    if kind == "function_call":
        call = validate_input(FunctionCallItem, item)
        tool_call = {
            "id": call.call_id,
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }
        return Turn(turn_id, "assistant", "", tool_calls=[tool_call])
    if kind == "function_call_output":
        result = validate_input(FunctionCallOutputItem, item)
        return Turn(turn_id, "tool", result.text(), tool_call_id=result.call_id)
    return None


def function_item_created(turn: Turn) -> dict:
    if turn.tool_call_id is not None:
        item = {
            "id": f"fco_{turn.turn_id}",
            "type": "function_call_output",
            "call_id": turn.tool_call_id,
            "output": turn.content,
            "status": turn.status,
        }
    else:
        item = call_item((turn.tool_calls or [])[0], turn.status)
    return {"type": "conversation.item.created", "item": item}


def call_events(response_id: str, events: tuple, first_index: int) -> list[dict]:
    """Realtime events for a choice's call events; output indices count from
    `first_index` (after the message item)."""
    out: list[dict] = []
    for e in events:
        where = {
            "response_id": response_id,
            "output_index": first_index + e.index,
        }
        if isinstance(e, CallStart):
            item = call_item({"id": e.id, "function": {"name": e.name, "arguments": ""}})
            item["status"] = "in_progress"
            out.append({"type": "response.output_item.added", **where, "item": item})
        elif isinstance(e, CallArgs):
            out.append(
                {
                    "type": "response.function_call_arguments.delta",
                    **where,
                    "item_id": "fc_" + e.id.removeprefix("call_"),
                    "delta": e.fragment,
                }
            )
        elif isinstance(e, CallDone):
            call = {"id": e.id, "function": {"name": e.name, "arguments": e.arguments}}
            item = call_item(call, "completed" if e.complete else "incomplete")
            out.append(
                {
                    "type": "response.function_call_arguments.done",
                    **where,
                    "item_id": item["id"],
                    "call_id": e.id,
                    "name": e.name,
                    "arguments": e.arguments,
                }
            )
            out.append({"type": "response.output_item.done", **where, "item": item})
    return out
