"""A run's tool calls: each choice's text through its parser (parse.py), the calls kept on
the choice for the final body, and the stream's chunks in OpenAI's shape.

Streamed `tool_calls` deltas: the first for a call carries `index`, `id`, `type` and the
`name` with `arguments: ""`; later ones carry only `index` and an argument fragment (the
shape llama.cpp #13800 settled on; concatenated, they equal the non-streamed call). A call
cut by max_tokens streams the deltas it got and the choice ends with `finish_reason:
"length"`; the non-streamed body lists only whole calls (the cut one is left out). The
agent fast path: with `stream_options.include_tool_call_done`, each call also goes out whole
as `event: tool_call.done` the moment its JSON closes, before the stream ends. Opt-in only,
since openai-python turns any unrequested named event into a malformed chunk.
"""

from __future__ import annotations

from typing import Any

import orjson

from ultrafast.server.tools.parse import CallArgs, CallDone, CallStart, Content, Event

TOOL_CALL_DONE_EVENT = "tool_call.done"


def call_dict(done: CallDone) -> dict:
    return {
        "id": done.id,
        "type": "function",
        "function": {"name": done.name, "arguments": done.arguments},
    }


class ToolSplitter:
    """Per choice: its parser, the calls so far (on `choice.tool_calls`), and the call
    events not yet streamed."""

    def __init__(self, plan: Any, choices: list) -> None:
        self.plan = plan
        self.choices = choices
        self.parsers = [plan.parser() for _ in choices]
        self.pending: list[list[Event]] = [[] for _ in choices]

    @classmethod
    def for_run(cls, plan: Any, choices: list) -> ToolSplitter | None:
        return None if plan is None or not plan.calls_allowed else cls(plan, choices)

    def split(self, index: int, text: str, finish: str | None) -> tuple[str, str | None]:
        """Content of this delta, and the finish reason: `tool_calls` when the choice
        called a tool, or (one call allowed) the moment its call closed."""
        parser = self.parsers[index]
        events = parser.push(text)
        if finish is None and self.plan.single and any(isinstance(e, CallDone) for e in events):
            finish = "tool_calls"
        if finish is not None:
            events += parser.finish(cut=finish != "stop")
            if finish == "stop" and parser.calls:
                finish = "tool_calls"
        choice = self.choices[index]
        for e in events:
            if isinstance(e, CallDone) and e.complete:  # a cut call: `length` says so
                choice.tool_calls.append(call_dict(e))
        self.pending[index] += [e for e in events if not isinstance(e, Content)]
        return "".join(e.text for e in events if isinstance(e, Content)), finish

    def take(self, index: int) -> tuple:
        out, self.pending[index] = tuple(self.pending[index]), []
        return out


def chat_tool_chunks(writer: Any, index: int, events: tuple, done_events: bool) -> list[bytes]:
    """SSE chunks for a choice's call events (chat completions)."""
    out = []
    for e in events:
        if isinstance(e, CallStart):
            call = {
                "index": e.index,
                "id": e.id,
                "type": "function",
                "function": {"name": e.name, "arguments": ""},
            }
            out.append(writer.tool_calls(index, [call]))
        elif isinstance(e, CallArgs):
            out.append(
                writer.tool_calls(
                    index, [{"index": e.index, "function": {"arguments": e.fragment}}]
                )
            )
        elif isinstance(e, CallDone) and done_events:
            payload = {"choice_index": index, "tool_call": {"index": e.index, **call_dict(e)}}
            out.append(
                f"event: {TOOL_CALL_DONE_EVENT}\n".encode()
                + b"data: "
                + orjson.dumps(payload)
                + b"\n\n"
            )
    return out
