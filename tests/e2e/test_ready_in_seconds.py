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
