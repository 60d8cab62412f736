"""Between the asyncio event loop and the engine thread: submit, stream outputs, abort.

The engine thread calls back with RequestOutputs; each is put on the caller's asyncio queue with
`loop.call_soon_threadsafe`, so the event loop never blocks on the engine and the engine never
waits for a slow client. `Generation` groups the n requests of one API call on one queue; the
HTTP layer aborts whatever is unfinished when the client leaves, freeing the KV slots in a step.
"""

from __future__ import annotations

import asyncio
from ultrafast.core.scheduler import RequestOutput
from ultrafast.request import Request
from ultrafast.runtime.engine import EngineThread


class EngineBridge:
    def __init__(self, engine: EngineThread, loop: asyncio.AbstractEventLoop):
        self.engine = engine
        self.loop = loop

    def submit(self, request: Request, queue: asyncio.Queue) -> None:
        loop = self.loop

        def on_output(output: RequestOutput) -> None:  # runs on the engine thread
            loop.call_soon_threadsafe(queue.put_nowait, output)

        self.engine.submit(request, on_output)

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)


class Generation:
    """The engine requests behind one API call (n choices), merged into one output stream."""

    def __init__(self, bridge: EngineBridge, requests: list[Request]):
        self.bridge = bridge
        self.requests = requests
        self.index_of = {r.request_id: i for i, r in enumerate(requests)}
        self.unfinished = set(self.index_of)
        self.queue: asyncio.Queue[RequestOutput] = asyncio.Queue()

    def start(self) -> "Generation":
        for request in self.requests:
            self.bridge.submit(request, self.queue)
        return self

    def abort(self, index: int) -> None:
        request_id = self.requests[index].request_id
        if request_id in self.unfinished:
            self.unfinished.discard(request_id)
            self.bridge.abort(request_id)

    def abort_from_server(self) -> None:
        """Abort but keep listening: the engine's abort outputs reach the client as a finish."""
        for request_id in list(self.unfinished):
            self.bridge.abort(request_id)

    def abort_all(self) -> None:
        for request_id in list(self.unfinished):
            self.bridge.abort(request_id)
        self.unfinished.clear()
