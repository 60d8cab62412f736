"""The engine->event-loop hand-off: every output arrives once, in order, with one wake per burst."""

import asyncio
import threading

from ultrafast.core.types import RequestOutput
from ultrafast.request import Request, SamplingParams, ServiceTier
from ultrafast.server.bridge import EngineBridge, OutputBuffer


class CapturingEngine:
    """Stands in for EngineThread: keeps each request's output callback."""

    def __init__(self):
        self.callbacks = {}

    def submit(self, request, on_output):
        self.callbacks[request.request_id] = on_output

    def abort(self, request_id):
        pass


def _request(request_id: str) -> Request:
    return Request(request_id, [1, 2], SamplingParams(max_tokens=4))


def test_a_burst_of_outputs_wakes_the_loop_once_and_keeps_order():
    async def main():
        engine = CapturingEngine()
        bridge = EngineBridge(engine, asyncio.get_running_loop())
        buffers = {rid: OutputBuffer(16) for rid in ("a", "b")}
        for rid, buffer in buffers.items():
            bridge.submit(_request(rid), buffer)

        def one_step(tokens):  # an engine step feeding both streams, from another thread
            for rid in ("a", "b"):
                engine.callbacks[rid](RequestOutput(rid, [tokens], finished=tokens == 3))

        worker = threading.Thread(target=lambda: [one_step(t) for t in (1, 2)])
        worker.start()
        worker.join()  # the loop has not run yet: 4 outputs pending, one drain scheduled
        assert bridge.num_wakes == 1
        got = {
            rid: [(await b.get()).new_token_ids[0] for _ in range(2)] for rid, b in buffers.items()
        }
        assert got == {"a": [1, 2], "b": [1, 2]}

        worker = threading.Thread(target=one_step, args=(3,))  # after the drain: a new wake
        worker.start()
        worker.join()
        assert bridge.num_wakes == 2
        last = {rid: await b.get() for rid, b in buffers.items()}
        assert all(o.finished and o.new_token_ids == [3] for o in last.values())
        assert all(b.qsize() == 0 for b in buffers.values())

    asyncio.run(main())


def test_outputs_after_the_loop_closed_are_dropped_quietly():
    loop = asyncio.new_event_loop()
    engine = CapturingEngine()
    bridge = EngineBridge(engine, loop)
    loop.run_until_complete(asyncio.sleep(0))
    buffer = loop.run_until_complete(_make_buffer())
    bridge.submit(_request("a"), buffer)
    loop.close()
    engine.callbacks["a"](RequestOutput("a", [1], finished=True))  # must not raise
    assert bridge.num_wakes == 0


async def _make_buffer() -> OutputBuffer:
    return OutputBuffer(4)


def test_a_priority_stream_is_handed_its_tokens_before_the_default_streams():
    async def main():
        engine = CapturingEngine()
        bridge = EngineBridge(engine, asyncio.get_running_loop())
        tiers = {"d1": ServiceTier.DEFAULT, "p": ServiceTier.PRIORITY, "d2": ServiceTier.FLEX}
        buffers = {rid: OutputBuffer(16) for rid in tiers}
        for rid, tier in tiers.items():
            request = _request(rid)
            request.tier = tier
            bridge.submit(request, buffers[rid])
        woke: list[str] = []

        async def reader(rid):
            await buffers[rid].get()
            woke.append(rid)

        readers = [asyncio.ensure_future(reader(rid)) for rid in tiers]
        await asyncio.sleep(0)  # every reader waits on its buffer
        step = threading.Thread(  # one step's outputs, in slot order: the default ones first
            target=lambda: [engine.callbacks[rid](RequestOutput(rid, [1])) for rid in tiers]
        )
        step.start()
        step.join()
        await asyncio.gather(*readers)
        assert woke == ["p", "d1", "d2"]

    asyncio.run(main())
