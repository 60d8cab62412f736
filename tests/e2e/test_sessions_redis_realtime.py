"""The server on a real redis-server (started here on a free port): outage -> 503 for session
calls while stateless calls work, a Redis restart mid-conversation (each turn stored exactly
once), and the realtime WebSocket (turns, streamed deltas, barge-in) with a real client."""

from __future__ import annotations

import json

import httpx
import pytest
from websockets.sync.client import connect

from ultrafast_harness.bench.server_process import ServerProcess
from ultrafast_harness.bench.sessions import (
    check_exactly_once,
    llama_cpp_floor,
    run_conversations,
    ttft_by_turn,
)


@pytest.fixture(scope="module")
def srv(redis_server):
    server = ServerProcess(
        "--priority-ttft-ms",
        "10000",
        "--session-store",
        redis_server.url,
        num_slots=4,
        max_model_len=2048,
    )
    yield server
    server.stop()


def _session_chat(srv, session_id: str, content: str) -> httpx.Response:
    return httpx.post(
        srv.url + "/v1/chat/completions",
        timeout=60,
        json={
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 4,
            "session_id": session_id,
        },
    )


def test_redis_down_refuses_session_calls_and_serves_stateless_ones(srv, redis_server):
    assert _session_chat(srv, "outage-1", "def a():").status_code == 200
    redis_server.stop()
    try:
        r = _session_chat(srv, "outage-1", "def b():")
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "session_store_unavailable"
        assert "retry-after" in r.headers
        assert httpx.get(srv.url + "/ready", timeout=30).json()["session_store"] == "degraded"
        stateless = httpx.post(
            srv.url + "/v1/chat/completions",
            timeout=60,
            json={"messages": [{"role": "user", "content": "def c():"}], "max_tokens": 4},
        )
        assert stateless.status_code == 200
        assert (
            httpx.post(
                srv.url + "/v1/responses",
                timeout=60,
                json={"input": "x", "store": False, "max_output_tokens": 2},
            ).status_code
            == 200
        )
    finally:
        redis_server.start()
    assert _session_chat(srv, "outage-1", "def b():").status_code == 200
    assert httpx.get(srv.url + "/ready", timeout=30).json()["session_store"] == "ok"
    items = httpx.get(srv.url + "/v1/conversations/outage-1/items?order=asc", timeout=30).json()
    assert [i["content"][0]["text"] for i in items["data"] if i["role"] == "user"] == [
        "def a():",
        "def b():",
    ]


def test_redis_restart_mid_conversation_keeps_every_turn_exactly_once(srv, redis_server):
    result = run_conversations(
        srv.url,
        num_sessions=6,
        num_turns=5,
        concurrency=4,
        max_tokens=6,
        restart=redis_server.restart,
        restart_after_turns=12,
        session_prefix="restart-test",
    )
    # Redis was down while conversations were under way (calls then either got 503 and were
    # retried by the client, or waited in the server's commit retry)
    assert result.num_restarts == 1 and result.num_turns_before_restart_end < 6 * 5
    report = check_exactly_once(srv.url, result)
    assert report["num_turns_found"] == 6 * 5 * 2 and report["problems"] == []


def test_session_turns_prefill_only_their_new_tokens(srv):
    """KV kept warm: from turn 2 on, everything before the new turn comes from the cache, so
    the tokens prefilled stay about one turn's worth while the history grows."""
    shapes: list[tuple[int, int]] = []
    ttfts = ttft_by_turn(
        srv.url, 4, turn_tokens=30, new_tokens=12, stateful=True, salt=7, shapes=shapes
    )
    assert len(ttfts) == len(shapes) == 4 and all(t > 0 for t in ttfts)
    cached = [c for c, _ in shapes]
    prefilled = [n for _, n in shapes]
    assert cached[1] < cached[2] < cached[3]  # the history grows and is served from the cache
    assert cached[3] > 3 * 30  # three earlier user turns and their answers
    assert max(prefilled[1:]) < 30 + 16  # the new user turn and its template, no history


def test_llama_cpp_floor_times_the_given_prefills():
    from ultrafast.model_files import gguf_for, resolve_model
    from ultrafast_harness.bench.server_process import DEMO_MODEL_DIR

    gguf = str(gguf_for(resolve_model(DEMO_MODEL_DIR)))
    floor = llama_cpp_floor(
        gguf, threads=1, shapes={"fresh": (0, 20), "after": (300, 20)}, rounds=2
    )
    assert set(floor) == {"fresh", "after"} and all(t > 0 for t in floor.values())


def test_torch_floor_times_the_given_prefills():
    import torch

    from ultrafast_harness.bench.server_process import DEMO_MODEL_DIR
    from ultrafast_harness.bench.sessions import torch_floor

    threads = torch.get_num_threads()
    try:
        floor = torch_floor(
            str(DEMO_MODEL_DIR), threads=1, shapes={"fresh": (0, 20), "after": (600, 20)}, rounds=2
        )
    finally:
        torch.set_num_threads(threads)
    assert set(floor) == {"fresh", "after"} and all(t > 0 for t in floor.values())


def _events_until(ws, kind: str) -> list[dict]:
    events = []
    while True:
        event = json.loads(ws.recv(timeout=60))
        events.append(event)
        if event["type"] in (kind, "error"):
            return events


def test_realtime_turns_stream_and_barge_in_keeps_only_what_was_sent(srv):
    ws_url = srv.url.replace("http://", "ws://") + "/v1/realtime"
    with connect(ws_url) as ws:
        created = json.loads(ws.recv(timeout=30))
        assert created["type"] == "session.created"
        conversation = created["session"]["id"]
        ws.send(
            json.dumps(
                {
                    "type": "conversation.item.create",
                    "item": {
                        "type": "message",
                        "role": "user",
                        "content": [{"type": "input_text", "text": "def fibonacci(n):"}],
                    },
                }
            )
        )
        assert (
            _events_until(ws, "conversation.item.created")[-1]["type"]
            == "conversation.item.created"
        )
        ws.send(
            json.dumps(
                {"type": "response.create", "response": {"max_output_tokens": 8, "temperature": 0}}
            )
        )
        events = _events_until(ws, "response.done")
        deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        done = events[-1]["response"]
        assert done["status"] == "completed" and done["output"][0]["content"][0]["text"] == deltas

        # barge-in: cancel after the first delta of a long answer
        ws.send(
            json.dumps(
                {
                    "type": "conversation.item.create",
                    "item": {"role": "user", "content": "def quicksort(items):"},
                }
            )
        )
        _events_until(ws, "conversation.item.created")
        ws.send(
            json.dumps(
                {
                    "type": "response.create",
                    "response": {"max_output_tokens": 1500, "temperature": 0},
                }
            )
        )  # greedy: runs to 1500 uncancelled
        first = _events_until(ws, "response.output_text.delta")
        assert first[-1]["type"] == "response.output_text.delta"
        ws.send(json.dumps({"type": "response.cancel"}))
        rest = _events_until(ws, "response.done")
        sent = "".join(
            e["delta"] for e in first + rest if e["type"] == "response.output_text.delta"
        )
        done = rest[-1]["response"]
        assert done["status"] == "cancelled"
        assert done["usage"]["completion_tokens"] < 1500  # stopped, not run to the end
        assert done["output"][0]["content"][0]["text"] == sent

        for bad in ("not json", "[" * 200_000):  # too deep for the parser: refused too
            ws.send(bad)
            assert json.loads(ws.recv(timeout=30))["error"]["code"] == "invalid_json"
        for options, code in (
            ({"max_output_tokens": "8"}, "invalid_type"),
            ({"temperature": 9}, "invalid_value"),
            ("x", "invalid_type"),
        ):
            ws.send(json.dumps({"type": "response.create", "response": options}))
            assert json.loads(ws.recv(timeout=30))["error"]["code"] == code  # nothing generated
    items = httpx.get(
        f"{srv.url}/v1/conversations/{conversation}/items?order=asc", timeout=30
    ).json()["data"]
    assert [(i["role"], i["status"]) for i in items] == [
        ("user", "completed"),
        ("assistant", "completed"),
        ("user", "completed"),
        ("assistant", "incomplete"),
    ]
    assert items[1]["content"][0]["text"] == deltas
    assert items[3]["content"][0]["text"] == sent  # only what the client actually received


def test_stored_chat_completions_on_redis_get_list_delete(srv):
    made = [
        httpx.post(
            srv.url + "/v1/chat/completions",
            timeout=60,
            json={
                "messages": [{"role": "user", "content": f"def r{i}():"}],
                "max_tokens": 3,
                "store": True,
                "metadata": {"suite": "redis"},
            },
        ).json()
        for i in range(2)
    ]
    got = httpx.get(srv.url + f"/v1/chat/completions/{made[1]['id']}", timeout=30).json()
    assert got["choices"][0]["message"]["content"] == made[1]["choices"][0]["message"]["content"]
    listed = httpx.get(
        srv.url + "/v1/chat/completions", timeout=30, params={"metadata[suite]": "redis"}
    ).json()
    assert [c["id"] for c in listed["data"]] == [c["id"] for c in made]
    messages = httpx.get(
        srv.url + f"/v1/chat/completions/{made[0]['id']}/messages", timeout=30
    ).json()["data"]
    assert [(m["role"], m["content"]) for m in messages] == [("user", "def r0():")]
    assert (
        httpx.delete(srv.url + f"/v1/chat/completions/{made[0]['id']}", timeout=30).json()[
            "deleted"
        ]
        is True
    )
    assert (
        httpx.get(srv.url + f"/v1/chat/completions/{made[0]['id']}", timeout=30).status_code == 404
    )
    listed = httpx.get(
        srv.url + "/v1/chat/completions", timeout=30, params={"metadata[suite]": "redis"}
    ).json()
    assert [c["id"] for c in listed["data"]] == [made[1]["id"]]
