"""Between the asyncio event loop and the engine thread: submit, stream outputs, abort.

The engine thread calls back with RequestOutputs; each goes on a shared hand-off deque and the
event loop moves it to the caller's buffer, so the event loop never blocks on the engine and the
engine never waits for a slow client. The engine wakes the loop (`call_soon_threadsafe`) only
when no drain is already pending: one wake per step however many streams it fed, since a wake
of the sleeping loop thread costs the engine tens of microseconds on a VM (BENCHMARKS.md).
`RequestGroup` groups the n requests of one API call on one queue; the HTTP layer aborts whatever
is unfinished when the client leaves, freeing the KV slots in a step.

A client slower than the engine cannot grow a stream's buffer without bound: past
`max_events` undelivered outputs, a new output is merged into its request's latest pending
one (the client then gets several tokens in one event), so the buffer holds at most
`max_events` + n outputs and no more token ids than max_tokens. A client that reads nothing at
all is cut by the connection's write-stall timeout (server/http_timeouts.py).
Once the event loop is closed (forced shutdown), late engine outputs are dropped quietly.

The import boundary (tests/unit/test_server_import_boundary.py): this is the only module of
ultrafast/server/ that imports from ultrafast.core, .runtime, .engine, .executors or
.sampling. The engine types the server needs are re-exported here (RequestOutput,
TokenLogprobs, EngineThread, EngineSnapshot, StepCostSnapshot, EngineSettings); the request contract
(Request, SamplingParams, ServiceTier) comes from ultrafast.request, which every layer shares.
The server reads the engine only through EngineThread's read API: `snapshot()`,
`cached_prefix_tokens()`, `configure()`, `alive`, `dead_reason`; moving the engine into its own
process later replaces this module's imports and nothing else.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from dataclasses import replace

from ultrafast.core.embed_queue import EmbedError, EmbedJob
from ultrafast.core.types import RequestOutput, TokenLogprobs
from ultrafast.engine.core import EngineCore
from ultrafast.engine.embed_engine import EmbeddingEngine
from ultrafast.engine.read_api import EngineSettings, EngineSnapshot, StepCostSnapshot
from ultrafast.engine.thread import EngineThread
from ultrafast.kvcache.manager import KVCacheSnapshot
from ultrafast.request import Request, ServiceTier

__all__ = [
    "EmbedError",
    "EmbedFailed",
    "EmbeddingEngine",
    "EngineBridge",
    "EngineSettings",
    "EngineSnapshot",
    "EngineThread",
    "RequestGroup",
    "OutputBuffer",
    "RequestOutput",
    "StepCostSnapshot",
    "TokenLogprobs",
    "embed",
    "merge_outputs",
    "kv_cache_reader",
    "shutdown_engine",
    "start_engine",
]


def start_engine(
    core: EngineCore, shaper_window_s: float, measure_speed: bool = True
) -> EngineThread:
    """The engine thread around a built EngineCore, warmed up on that thread (see
    EngineThread.start): the server holds only the thread and its read API."""
    return EngineThread(core, shaper_window_s=shaper_window_s).start(
        warmup=True, measure_speed=measure_speed, background=True
    )


def kv_cache_reader(engine: EngineThread) -> Callable[[], KVCacheSnapshot | None] | None:
    """The tiered KV cache's counters (for server/kv_metrics.py), or None when it is off."""
    kv_cache = engine.core.kv_cache
    return None if kv_cache is None else kv_cache.snapshot


def shutdown_engine(engine: EngineThread) -> None:
    engine.stop()
    engine.core.close()


class OutputBuffer:
    """One stream's undelivered outputs (event-loop side only); bounded by merging."""

    def __init__(self, max_events: int):
        self.max_events = max(1, max_events)
        self.num_merged = 0
        self._items: collections.deque[RequestOutput] = collections.deque()
        self._ready = asyncio.Event()
        self._interrupted = False

    def qsize(self) -> int:
        return len(self._items)

    def put_nowait(self, output: RequestOutput) -> None:
        if len(self._items) >= self.max_events:
            for i in range(len(self._items) - 1, -1, -1):
                pending = self._items[i]
                if pending.request_id == output.request_id:
                    if not pending.finished:
                        self._items[i] = merge_outputs(pending, output)
                        self.num_merged += 1
                        return
                    break
        self._items.append(output)
        self._ready.set()

    async def get(self) -> RequestOutput | None:
        """The next output, or None when `interrupt()` ended the wait with nothing to deliver.
        Safe to cancel: nothing is taken before the wait ends."""
        while not self._items:
            if self._interrupted:
                self._interrupted = False
                return None
            self._ready.clear()
            await self._ready.wait()
        return self._items.popleft()

    def interrupt(self) -> None:
        """End a pending (or the next) `get()` at once, e.g. a barge-in that must not wait
        for the engine's abort output."""
        self._interrupted = True
        self._ready.set()


def merge_outputs(first: RequestOutput, then: RequestOutput) -> RequestOutput:
    """Two consecutive outputs of one request as one (tokens in order, the later state)."""
    return replace(
        then,
        new_token_ids=first.new_token_ids + then.new_token_ids,
        new_logprobs=first.new_logprobs + then.new_logprobs,
        queue_time_s=first.queue_time_s,
        prompt_logprobs=first.prompt_logprobs or then.prompt_logprobs,
    )


class EngineBridge:
    def __init__(
        self,
        engine: EngineThread,
        loop: asyncio.AbstractEventLoop,
        max_stream_buffer_events: int = 256,
    ):
        self.engine = engine
        self.loop = loop
        self.max_stream_buffer_events = max_stream_buffer_events
        self._handoff: collections.deque[tuple[OutputBuffer, RequestOutput]] = collections.deque()
        # priority outputs are handed over first: their streams' tasks then wake (and write)
        # ahead of a step's default/flex tokens (one stream's outputs stay in one deque: order)
        self._handoff_priority: collections.deque[tuple[OutputBuffer, RequestOutput]] = (
            collections.deque()
        )
        self._drain_pending = False
        self.num_wakes = 0

    def submit(self, request: Request, queue: OutputBuffer) -> None:
        handoff = self._handoff_priority if request.tier == ServiceTier.PRIORITY else self._handoff

        def on_output(output: RequestOutput) -> None:  # runs on the engine thread
            handoff.append((queue, output))
            self._wake()

        self.engine.submit(request, on_output)

    def _wake(self) -> None:
        """Engine thread: make sure a drain will run. Append before this check, and the loop
        clears the flag before it drains: an output is then always drained by a pending or a
        new drain (at worst one drain finds nothing)."""
        if self._drain_pending or self.loop.is_closed():
            return  # a drain is coming, or nobody is listening any more (forced shutdown)
        self._drain_pending = True
        self.num_wakes += 1
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # closed between the check and the call
            pass

    def _drain(self) -> None:
        """Event loop: move every handed-off output to its stream's buffer, in order."""
        self._drain_pending = False
        for handoff in (self._handoff_priority, self._handoff):
            while handoff:
                queue, output = handoff.popleft()
                queue.put_nowait(output)

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)


class RequestGroup:
    """The engine requests behind one API call (n choices), merged into one output stream."""

    def __init__(self, bridge: EngineBridge, requests: list[Request]):
        self.bridge = bridge
        self.requests = requests
        self.index_of = {r.request_id: i for i, r in enumerate(requests)}
        self.unfinished = set(self.index_of)
        self.queue = OutputBuffer(bridge.max_stream_buffer_events)

    def start(self) -> RequestGroup:
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

    def interrupt(self) -> None:
        """Abort every choice and wake the consumer now: its wait returns None."""
        self.abort_all()
        self.queue.interrupt()


class EmbedFailed(Exception):
    def __init__(self, error: EmbedError):
        super().__init__(error.message)
        self.error = error


async def embed(engine: EmbeddingEngine, inputs: list[list[int]], tier: ServiceTier) -> list:
    """The inputs' vectors from the embedding engine's next passes (batched with whatever else
    waits); EmbedFailed when it refuses or fails. A cancelled caller cancels the job."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def settle(vectors: list | None, error: EmbedError | None) -> None:
        if not future.done():
            if error is None:
                future.set_result(vectors)
            else:
                future.set_exception(EmbedFailed(error))

    def on_done(vectors: list | None, error: EmbedError | None) -> None:  # engine thread
        try:
            loop.call_soon_threadsafe(settle, vectors, error)
        except RuntimeError:  # the loop is closed (forced shutdown): nobody waits
            pass

    job = EmbedJob(inputs, tier, on_done)
    engine.submit(job)
    try:
        return await future
    except asyncio.CancelledError:
        engine.cancel(job)
        raise
