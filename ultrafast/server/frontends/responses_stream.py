"""The Responses API's stream: `response.created` ... `response.completed`, one output item
per message or function call, each with the next output index as it starts.

Without tools the message item opens at once (before any token); with tools it opens at its
first text, since a reply may be calls only. Each call's `output_item.done` goes out when
its JSON closes, before the response ends (the agent fast path, tools/responses_api.py).
"""

from __future__ import annotations

from typing import Any

from ultrafast.server.generate import GenerationRun, Ping
from ultrafast.server.tools.responses_api import CallEvents

# `b` below is responses.ResponseBuilder (responses.py imports this module, not the reverse)
ResponseBuilder = Any


def final_status(run: GenerationRun) -> str:
    return "completed" if run.choices[0].finish_reason in ("stop", "tool_calls") else "incomplete"


async def stream_response(run: GenerationRun, b: ResponseBuilder):
    run.start()
    calls = None if run.tools is None else CallEvents(b)
    # without tools the message item opens at once; with tools, at its first text (a reply
    # may be calls only), each item taking the next output index as it starts
    message_open = calls is None
    next_index = 1 if message_open else 0  # the next free output index
    try:
        yield b.event("response.created", response=b.body("in_progress"))
        yield b.event("response.in_progress", response=b.body("in_progress"))
        if message_open:
            yield _open_message(b)
        async for event in run.events():
            if isinstance(event, Ping):
                yield b": ping\n\n"
                continue
            if event.finish == "error":
                break
            if event.text:
                if not message_open:
                    message_open, b.message_index = True, next_index
                    next_index += 1
                    yield _open_message(b)
                yield b.event(
                    "response.output_text.delta", delta=event.text, logprobs=[], **b.where()
                )
            if calls is not None and event.tool_events:  # each call whole at its close
                chunks, next_index = calls.events(event.tool_events, next_index)
                for chunk in chunks:
                    yield chunk
        error = await run.conclude()
        if error is not None and error.status >= 500 and run.choices[0].error:
            yield b.event(
                "response.failed",
                response=b.body("failed", error={"code": "server_error", "message": error.message}),
            )
            return
        choice = run.choices[0]
        status = final_status(run)
        if not message_open and not choice.tool_calls:  # an empty answer is still a message
            message_open, b.message_index = True, next_index
            yield _open_message(b)
        if message_open:
            item_status = "completed" if status == "completed" else "incomplete"
            yield b.event("response.output_text.done", text=choice.text, logprobs=[], **b.where())
            yield b.event("response.content_part.done", part=b.text_part(choice.text), **b.where())
            yield b.event(
                "response.output_item.done",
                output_index=b.message_index,
                item=b.message_item(item_status, choice.text),
            )
        body = b.final(run, error.code if error is not None else None)
        yield b.event(
            "response.completed" if status == "completed" else "response.incomplete", response=body
        )
    finally:
        run.finish()


def _open_message(b: ResponseBuilder) -> bytes:
    return b.event(
        "response.output_item.added",
        output_index=b.message_index,
        item=b.message_item("in_progress", None),
    ) + b.event("response.content_part.added", part=b.text_part(""), **b.where())
