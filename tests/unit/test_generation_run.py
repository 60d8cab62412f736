"""GenerationRun's lifecycle and typed events, driven by hand-made engine outputs: deltas and
pings, the commit awaited once at the end (or scheduled once when the client left), one error
for a failed run, and the barge-in interrupt that ends the wait without a fake output."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from ultrafast.config import DEMO_MODEL_DIR, ServerConfig
from ultrafast.request import SamplingParams, ServiceTier
from ultrafast.server.admission import Admission
from ultrafast.server.bridge import EngineBridge, RequestOutput
from ultrafast.server.generate import ChoiceDelta, GenerationRun, GenerationSpec, Ping, RunDeps
from ultrafast.server.metrics import ServerMetrics
from ultrafast.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(DEMO_MODEL_DIR)


class CapturingEngine:
    """Stands in for EngineThread: keeps each request's output callback and its aborts."""

    def __init__(self):
        self.callbacks, self.aborted = {}, []

    def submit(self, request, on_output):
        self.callbacks[request.request_id] = on_output

    def abort(self, request_id):
        self.aborted.append(request_id)


def make_run(tok, ping_interval_s=5.0, **spec_changes):
    """A run over a CapturingEngine; `spec_changes` replace GenerationSpec fields."""
    engine = CapturingEngine()
    admission = Admission(ServerConfig())
    deps = RunDeps(
        bridge=EngineBridge(engine, asyncio.get_running_loop()),
        tokenizer=tok,
        admission=admission,
        metrics=ServerMetrics(),
        guard=None,
        runs=set(),
        ping_interval_s=ping_interval_s,
    )
    spec = GenerationSpec(
        request_id="chatcmpl-t",
        model_name="m",
        prompts=[[1, 2, 3]],
        params=SamplingParams(max_tokens=8),
        n=1,
        tier=ServiceTier.DEFAULT,
        stops=[],
        chat=True,
        stream=False,
        include_usage=False,
        want_logprobs=False,
    )
    spec = replace(spec, **spec_changes)
    ticket = admission.reserve(ServiceTier.DEFAULT)
    return GenerationRun(deps, spec, ticket), engine


class CommitLog:
    def __init__(self, answer=None):
        self.calls, self.answer = [], answer

    async def __call__(self, run, reason):
        self.calls.append((run.choices[0].text, reason))
        return self.answer


async def events_of(run):
    return [e async for e in run.events()]


def test_deltas_then_one_commit_at_the_end_and_everything_freed(tok):
    async def main():
        run, engine = make_run(tok)
        commit, refunds = CommitLog(), []
        run.set_commit(commit)
        run.on_finish(lambda r: refunds.append(sum(r.num_output_tokens)))
        run.start()
        ids = tok.encode("return a + b", False)
        feed = engine.callbacks["chatcmpl-t-0-0"]
        feed(RequestOutput("chatcmpl-t-0-0", ids[:2], num_output_tokens=2))
        feed(
            RequestOutput(
                "chatcmpl-t-0-0",
                ids[2:],
                finished=True,
                finish_reason="length",
                num_output_tokens=len(ids),
            )
        )
        events = await events_of(run)
        assert all(isinstance(e, ChoiceDelta) for e in events)
        assert "".join(e.text for e in events) == "return a + b"
        assert events[-1].finish == "length"
        assert await run.conclude() is None
        run.finish()
        run.finish()  # twice is harmless: freed once
        await asyncio.sleep(0)
        assert commit.calls == [("return a + b", None)]  # awaited once, never rescheduled
        assert refunds == [len(ids)]
        assert run.deps.admission.in_flight[ServiceTier.DEFAULT] == 0 and not run.deps.runs

    asyncio.run(main())


def test_a_client_that_leaves_gets_its_partial_answer_committed_once(tok):
    async def main():
        run, engine = make_run(tok)
        commit = CommitLog()
        run.set_commit(commit)
        run.start()
        engine.callbacks["chatcmpl-t-0-0"](
            RequestOutput("chatcmpl-t-0-0", tok.encode("x = 1", False))
        )
        events = run.events()
        assert isinstance(await events.__anext__(), ChoiceDelta)
        run.finish()  # the client left mid-stream
        await asyncio.sleep(0.01)
        assert commit.calls == [("x = 1", "client_disconnected")]
        assert engine.aborted == ["chatcmpl-t-0-0"]
        assert await run.commit() is None and len(commit.calls) == 1

    asyncio.run(main())


def test_an_engine_failure_is_one_500_and_a_failed_commit_one_503(tok):
    async def main():
        run, engine = make_run(tok)
        run.start()
        engine.callbacks["chatcmpl-t-0-0"](
            RequestOutput("chatcmpl-t-0-0", [], finished=True, finish_reason="error", error="boom")
        )
        assert [e.finish for e in await events_of(run)] == ["error"]
        error = await run.conclude()
        assert (error.status, error.code) == (500, "engine_error")
        run.finish()

        run, engine = make_run(tok)
        run.set_commit(CommitLog(answer="session_commit_failed"))
        run.start()
        engine.callbacks["chatcmpl-t-0-0"](
            RequestOutput(
                "chatcmpl-t-0-0", tok.encode("y", False), finished=True, finish_reason="stop"
            )
        )
        await events_of(run)
        error = await run.conclude()
        assert (error.status, error.code) == (503, "session_commit_failed")
        assert error.headers["Retry-After"] == "1"
        run.finish()

    asyncio.run(main())


def test_a_quiet_engine_gives_pings(tok):
    async def main():
        run, _ = make_run(tok, ping_interval_s=0.01)
        run.start()
        events = run.events()
        assert isinstance(await events.__anext__(), Ping)
        assert isinstance(await events.__anext__(), Ping)
        run.finish()

    asyncio.run(main())


def test_an_interrupt_ends_the_wait_without_an_engine_output(tok):
    async def main():
        run, engine = make_run(tok)  # pings 5 s apart: only the interrupt can end the wait
        run.start()
        waiting = asyncio.ensure_future(run.events().__anext__())
        await asyncio.sleep(0)  # the loop now waits on the queue
        run.generation.interrupt()  # barge-in
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(waiting, 2.0)
        assert engine.aborted == ["chatcmpl-t-0-0"]
        run.finish()

    asyncio.run(main())
