"""The benchmark's lean SSE client reads the same stream a library client does."""

import asyncio

import httpx
import pytest

from ultrafast_harness.bench.overhead import lean_round
from ultrafast_harness.bench.sse_client import StreamError, completion_token_stamps, stream_events

BODY = {"prompt": "def add(a, b):\n", "max_tokens": 12, "temperature": 0, "ignore_eos": True}


def test_lean_client_text_matches_non_streamed(server):
    expected = httpx.post(server.url + "/v1/completions", json=BODY, timeout=60).json()["choices"][
        0
    ]["text"]

    async def collect() -> tuple[str, int]:
        text, finishes = "", 0
        async for _, event in stream_events(
            "127.0.0.1", server.port, "/v1/completions", {**BODY, "stream": True}
        ):
            choice = event["choices"][0]
            text += choice["text"]
            finishes += choice["finish_reason"] is not None
        return text, finishes

    text, finishes = asyncio.run(collect())
    assert text == expected
    assert finishes == 1


def test_lean_client_stamps_every_token(server):
    start, stamps = asyncio.run(
        completion_token_stamps(
            "127.0.0.1", server.port, {**BODY, "stream": True, "max_tokens": 16}
        )
    )
    assert 1 <= len(stamps) <= 16  # one stamp per non-empty text delta
    assert stamps == sorted(stamps) and stamps[0] >= start
    assert asyncio.run(lean_round(server.port, 16)) > 0


def test_lean_client_reports_http_errors(server):
    with pytest.raises(StreamError, match="HTTP 400"):
        asyncio.run(
            completion_token_stamps(
                "127.0.0.1", server.port, {**BODY, "stream": True, "max_tokens": -1}
            )
        )


def test_handoff_rounds_deliver_every_token_both_ways():
    from ultrafast.core.scheduler import SchedulerConfig
    from ultrafast.engine.core import EngineCore
    from ultrafast.executors.fake_exec import FakeExecutor
    from ultrafast_harness.bench.overhead import handoff_rounds

    core = EngineCore(FakeExecutor(num_slots=2), SchedulerConfig(max_num_seqs=2, max_model_len=64))
    kept, handed = handoff_rounds(core, [1, 2, 3], max_tokens=8, rounds=2)
    assert len(kept) == len(handed) == 2  # the warm-up round is not counted
    assert all(rate > 0 for rate in kept + handed)  # _rate needs all 8 tokens stamped
    assert not core.has_work()
