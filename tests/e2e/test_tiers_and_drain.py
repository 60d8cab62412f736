"""SLO admission (429 for a priority call that cannot meet its target) and the SIGTERM drain."""

from __future__ import annotations

import signal
import threading
import time

import httpx

from ultrafast.bench.server_process import ServerProcess

BODY = {"messages": [{"role": "user", "content": "def fibonacci(n):"}], "max_tokens": 4}


def test_priority_refused_when_target_unreachable_and_auto_falls_back():
    srv = ServerProcess("--priority-ttft-ms", "0.001")
    try:
        r = httpx.post(
            srv.url + "/v1/chat/completions", json={**BODY, "service_tier": "priority"}, timeout=30
        )
        assert r.status_code == 429, r.text
        err = r.json()["error"]
        assert err["code"] == "priority_slo_unattainable" and err["predicted_ttft_ms"] > 0
        assert int(r.headers["retry-after"]) >= 1
        auto = httpx.post(
            srv.url + "/v1/chat/completions", json={**BODY, "service_tier": "auto"}, timeout=30
        )
        assert auto.status_code == 200 and auto.json()["service_tier"] == "default"
    finally:
        srv.stop()


def test_sigterm_drains_running_streams_then_exits_zero():
    srv = ServerProcess("--drain-timeout-s", "20")
    events: list[str] = []

    def stream():
        with httpx.stream(
            "POST",
            srv.url + "/v1/completions",
            timeout=60,
            json={
                "prompt": "import os",
                "max_tokens": 400,
                "stream": True,
                "ignore_eos": True,
                "temperature": 0,
            },
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    events.append(line)

    t = threading.Thread(target=stream)
    t.start()
    while not events:
        time.sleep(0.01)
    srv.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    assert httpx.get(srv.url + "/ready").status_code == 503
    refused = httpx.post(srv.url + "/v1/chat/completions", json=BODY, timeout=10)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_shutting_down"
    assert "retry-after" in refused.headers
    t.join(60)
    assert events[-1] == "data: [DONE]"
    assert '"finish_reason":"length"' in events[-2] or '"finish_reason":"length"' in events[-3]
    assert srv.proc.wait(30) == 0
