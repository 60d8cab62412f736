"""Ready in seconds, end to end (server/startup.py, engine/start_costs.py): a taken port is an
error before the model loads; with nothing cached the server serves at once and measures its
start costs in the background, caches them, and the next start reuses them."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import httpx
import pytest

from ultrafast.config import DEMO_MODEL_DIR
from ultrafast_harness.bench.server_process import ServerProcess

CHAT = {"messages": [{"role": "user", "content": "def add(a, b):"}], "max_tokens": 4}


def test_a_taken_port_is_reported_before_the_model_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "ultrafast.cli", "serve", str(DEMO_MODEL_DIR)]
            + ["--port", str(port)],
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert done.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr and "--port" in done.stderr
    assert "KV slots" not in done.stdout + done.stderr  # nothing of the model was loaded


def _ready(url: str) -> dict:
    return httpx.get(url + "/ready", timeout=10).json()


def test_start_costs_are_measured_in_the_background_then_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("ULTRAFAST_CACHE_DIR", str(tmp_path))
    args = ("--num-slots", "4", "--max-model-len", "256")
    srv = ServerProcess(*args, model=DEMO_MODEL_DIR)  # waits for /health, then start costs
    try:
        ready = _ready(srv.url)
        assert ready["start_costs"] in ("measured", "contended"), ready
        assert ready["idle_speed"]["ttft_ms"] > 0
        assert (
            httpx.post(srv.url + "/v1/chat/completions", json=CHAT, timeout=60).status_code == 200
        )
    finally:
        srv.stop()
    cached = list((tmp_path / "start-costs").glob("*.json"))
    if ready["start_costs"] == "contended":
        assert not cached  # a plan timed under contention is never reused
        pytest.skip("the machine was too busy for a plan worth caching")
    assert len(cached) == 1
    plan = json.loads(cached[0].read_text())["thread_plan"]
    assert plan["widths"][0] == 1 and plan["threads"]
    again = ServerProcess(*args, model=DEMO_MODEL_DIR)
    try:
        ready = _ready(again.url)
        assert ready["start_costs"] == "cached" and ready["idle_speed"]["ttft_ms"] > 0
    finally:
        again.stop()


LONG_CODE = "".join(f"def f{i}(a):\n    return a + {i}\n" for i in range(40))  # ~500 tokens
LONG_CHAT = {
    "messages": [{"role": "user", "content": LONG_CODE}],
    "max_tokens": 4,
    "temperature": 0,
}


def _wait_ready(url: str, done, timeout_s: float = 300) -> dict:
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready = _ready(url)
        if done(ready):
            return ready
        time.sleep(0.5)
    raise AssertionError(f"/ready never got there: {ready}")


def test_the_wide_path_loads_by_need_and_its_routing_is_cached(tmp_path, monkeypatch):
    """Started at the defaults (--wide-pass auto): nothing of the wide path until a long prompt
    needs it; that prompt is answered on llama.cpp meanwhile; the routing is timed on the idle
    engine and cached; the next start knows it without timing."""
    monkeypatch.setenv("ULTRAFAST_CACHE_DIR", str(tmp_path))
    args = ("--num-slots", "4", "--max-model-len", "1024", "--threads", "1")
    srv = ServerProcess(*args, model=DEMO_MODEL_DIR)
    try:
        ready = _ready(srv.url)
        if ready["wide_pass"].startswith("off (not available"):
            pytest.skip(f"the wide path cannot run here: {ready['wide_pass']}")
        assert ready["wide_pass"].startswith("by need"), ready
        chat = httpx.post(srv.url + "/v1/chat/completions", json=CHAT, timeout=60)
        assert chat.status_code == 200 and _ready(srv.url)["wide_pass"].startswith("by need")
        url = srv.url + "/v1/chat/completions"
        first = httpx.post(url, json=LONG_CHAT, timeout=120)
        assert first.status_code == 200 and first.json()["choices"][0]["message"]["content"]
        ready = _wait_ready(srv.url, lambda r: r["wide_pass"].startswith(("on", "off")))
        assert ready["wide_pass"].startswith(("on (auto)", "off (measured not faster")), ready
        again = httpx.post(url, json=LONG_CHAT, timeout=120)
        assert again.status_code == 200 and again.json()["choices"][0]["message"]["content"]
    finally:
        srv.stop()
    decided = ready["wide_pass"]
    records = [json.loads(p.read_text()) for p in (tmp_path / "start-costs").glob("*.json")]
    assert any(r.get("status") == decided for r in records), records
    restarted = ServerProcess(*args, model=DEMO_MODEL_DIR)
    try:
        ready = _ready(restarted.url)
        if decided.startswith("on"):
            assert "routing cached" in ready["wide_pass"], ready
        else:
            assert ready["wide_pass"] == f"{decided} (cached)", ready
    finally:
        restarted.stop()
