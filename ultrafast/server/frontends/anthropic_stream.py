"""The Messages API's stream, in Anthropic's event order.

`message_start` (usage so far: the prompt, its cached part), `ping`, then per content block
`content_block_start`, its `content_block_delta`s (`text_delta`, or `input_json_delta` for a
tool call's arguments as the model writes them) and `content_block_stop`; then
`message_delta` (stop_reason, stop_sequence, output tokens) and `message_stop`. A text block
opens at the first text; a tool_use block at the call's start, and closes when its JSON does.
A quiet interval sends `ping`; a failure after the first byte is an `error` event.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import orjson

from ultrafast.server.generate import ChoiceDelta, GenerationRun, Ping, RunEvent
from ultrafast.server.tools.parse import CallArgs, CallDone, CallStart


def sse(name: str, payload: dict) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


class BlockWriter:
    """Content blocks in order: each new block closes the one before."""

    def __init__(self) -> None:
        self.index = -1
        self.open_kind: str | None = None
        self.call_blocks: dict[int, int] = {}  # the parser's call index -> block index

    def close(self) -> list[bytes]:
        if self.open_kind is None:
            return []
        self.open_kind = None
        return [sse("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def open(self, kind: str, block: dict) -> list[bytes]:
        out = self.close()
        self.index += 1
        self.open_kind = kind
        payload = {"type": "content_block_start", "index": self.index, "content_block": block}
        return [*out, sse("content_block_start", payload)]

    def delta(self, delta: dict, index: int | None = None) -> bytes:
        where = self.index if index is None else index
        return sse(
            "content_block_delta", {"type": "content_block_delta", "index": where, "delta": delta}
        )

    def text(self, text: str) -> list[bytes]:
        out = [] if self.open_kind == "text" else self.open("text", {"type": "text", "text": ""})
        return [*out, self.delta({"type": "text_delta", "text": text})]

    def calls(self, events: tuple, tool_use_id) -> list[bytes]:
        out: list[bytes] = []
        for e in events:
            if isinstance(e, CallStart):
                block = {"type": "tool_use", "id": tool_use_id(e.id), "name": e.name, "input": {}}
                out += self.open("tool_use", block)
                self.call_blocks[e.index] = self.index
            elif isinstance(e, CallArgs) and e.fragment:
                delta = {"type": "input_json_delta", "partial_json": e.fragment}
                out.append(self.delta(delta, self.call_blocks.get(e.index)))
            elif isinstance(e, CallDone) and self.call_blocks.get(e.index) == self.index:
                out += self.close()
        return out


async def stream_message(
    run: GenerationRun, first: list[RunEvent], events, builder
) -> AsyncIterator[bytes]:
    """`builder` is anthropic.MessageBuilder: the message's fields and final values."""
    blocks = BlockWriter()
    try:
        start = {"type": "message_start", "message": builder.start_message(run)}
        yield sse("message_start", start)
        yield sse("ping", {"type": "ping"})
        async for event in _chained(first, events):
            if isinstance(event, Ping):
                yield sse("ping", {"type": "ping"})
                continue
            if event.finish == "error":
                break
            for chunk in _event_chunks(blocks, event, builder):
                yield chunk
        error = await run.conclude()
        if error is not None:
            yield sse("error", builder.error_body(error))
            return
        if blocks.index < 0:  # an empty answer is still one (empty) text block
            for chunk in blocks.open("text", {"type": "text", "text": ""}):
                yield chunk
        for chunk in blocks.close():
            yield chunk
        reason, sequence = builder.stop_reason(run)
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": builder.usage(run),
        }
        yield sse("message_delta", delta)
        yield sse("message_stop", {"type": "message_stop"})
    finally:
        run.finish()


def _event_chunks(blocks: BlockWriter, event: ChoiceDelta, builder) -> list[bytes]:
    out = blocks.text(event.text) if event.text else []
    if event.tool_events:
        out += blocks.calls(event.tool_events, builder.tool_use_id)
    return out


async def _chained(first: list[RunEvent], rest) -> AsyncIterator[RunEvent]:
    for event in first:
        yield event
    async for event in rest:
        yield event
