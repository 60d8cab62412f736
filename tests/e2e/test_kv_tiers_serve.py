"""The tiered KV cache in real servers (demo model, ggml executor): a conversation's next
turn restores its KV after `kill -9` and a restart on the same disk tier, continues on another
server process through Redis, and recomputes (same answer) while Redis is down."""

from __future__ import annotations

import time

import httpx
import pytest
import redis

from ultrafast_harness.bench.server_process import ServerProcess

COMMON = ("--priority-ttft-ms", "10000", "--threads", "1")
USER_1 = "def load_config(path):\n    " + " ".join(f"value_{i} = {i}" for i in range(40))
USER_2 = "def save_config(path, config):"


def _chat(srv: ServerProcess, messages: list[dict]) -> tuple[str, int]:
    r = httpx.post(
        srv.url + "/v1/chat/completions",
        timeout=120,
        json={"messages": messages, "max_tokens": 8, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    return body["choices"][0]["message"]["content"], cached


def _conversation(first: ServerProcess, second: ServerProcess, wait_saved) -> tuple[str, int]:
    """Turn 1 on `first`, turn 2 on `second` once `wait_saved()` says turn 1's KV is stored."""
    answer, _ = _chat(first, [{"role": "user", "content": USER_1}])
    wait_saved()
    history = [
        {"role": "user", "content": USER_1},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": USER_2},
    ]
    return _chat(second, history)


def _until(condition, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _metric(srv: ServerProcess, name: str) -> float:
    text = httpx.get(srv.url + "/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


@pytest.fixture(scope="module")
def reference():
    """Turn 2's answer computed from scratch by a server without tiers."""
    srv = ServerProcess(*COMMON, num_slots=2, max_model_len=1024)
    try:
        yield _conversation(srv, srv, lambda: None)
    finally:
        srv.stop()


def test_kill_9_and_restart_restores_from_disk(tmp_path, reference):
    args = (*COMMON, "--kv-disk-dir", str(tmp_path))
    first = ServerProcess(*args, num_slots=2, max_model_len=1024)
    second = None
    try:

        def crash_when_saved():
            _until(lambda: list(tmp_path.glob("*.kv")), "the turn's KV on disk")
            first.proc.kill()  # kill -9: no graceful flush
            first.proc.wait()

        def restarted():
            nonlocal second
            second = ServerProcess(*args, num_slots=2, max_model_len=1024)
            return second

        answer, _ = _chat(first, [{"role": "user", "content": USER_1}])
        crash_when_saved()
        history = [
            {"role": "user", "content": USER_1},
            {"role": "assistant", "content": answer},
            {"role": "user", "content": USER_2},
        ]
        text, cached = _chat(restarted(), history)
        assert cached > 32, "turn 2 after the restart recomputed its history"
        assert text == reference[0]
        assert _metric(second, 'ultrafast_kv_tier_hit_tokens_total{tier="L3_disk"}') > 0
    finally:
        first.stop()
        if second is not None:
            second.stop()


def test_conversation_moves_to_another_process_through_redis(redis_server, reference):
    client = redis.Redis.from_url(redis_server.url)
    args = (*COMMON, "--kv-store", redis_server.url)
    first = ServerProcess(*args, num_slots=2, max_model_len=1024)
    second = ServerProcess(*args, num_slots=2, max_model_len=1024)
    try:
        text, cached = _conversation(
            first, second, lambda: _until(lambda: client.keys("uf:kv:*"), "the KV in Redis")
        )
        assert cached > 32 and text == reference[0]
        assert _metric(second, 'ultrafast_kv_tier_hit_tokens_total{tier="L3_redis"}') > 0

        redis_server.stop()  # an outage: turns recompute, nothing fails
        try:
            text, cached = _conversation(second, first, lambda: None)
            assert text == reference[0]
            assert _metric(first, 'ultrafast_kv_tier_degraded{tier="L3_redis"}') == 1
        finally:
            redis_server.start()
    finally:
        first.stop()
        second.stop()
        client.close()
