"""SLO admission (429 for a priority call that cannot meet its target) and the SIGTERM drain."""

from __future__ import annotations

import signal
import threading
import time

import httpx

from ultrafast_harness.bench.server_process import ServerProcess

BODY = {"messages": [{"role": "user", "content": "def fibonacci(n):"}], "max_tokens": 4}


def wait_until_running(url: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while httpx.get(url + "/ready", timeout=10).json()["running"] < 1:
        assert time.monotonic() < deadline, "the engine never showed a running request"
        time.sleep(0.01)


def test_priority_is_refused_only_for_the_queues_wait_and_auto_falls_back():
    srv = ServerProcess("--priority-ttft-ms", "0.001")  # no request can meet it
    chat = srv.url + "/v1/chat/completions"
    try:
        ready = httpx.get(srv.url + "/ready", timeout=10).json()
        assert ready["tier_targets"]["priority"]["ttft_source"] == "configured"
        assert ready["idle_speed"]["prompt_tokens"] > 0  # measured at start
        # idle: its own prefill is never a reason to refuse
        idle = httpx.post(chat, json={**BODY, "service_tier": "priority"}, timeout=30)
        assert idle.status_code == 200 and idle.json()["service_tier"] == "priority", idle.text
        with httpx.stream(
            "POST",
            srv.url + "/v1/completions",
            timeout=60,
            json={"prompt": "import os", "max_tokens": 480, "stream": True, "ignore_eos": True},
        ) as busy:
            lines = busy.iter_lines()  # kept: a closed iterator would close the stream
            next(line for line in lines if line.startswith("data:"))
            wait_until_running(srv.url)  # a running sequence shares every step from here
            r = httpx.post(chat, json={**BODY, "service_tier": "priority"}, timeout=30)
            assert r.status_code == 429, r.text
            err = r.json()["error"]
            assert err["code"] == "priority_slo_unattainable" and err["queue_wait_ms"] > 0
            assert (
                err["predicted_ttft_ms"] > err["queue_wait_ms"] and "queued ahead" in err["message"]
            )
            assert int(r.headers["retry-after"]) >= 1
            auto = httpx.post(chat, json={**BODY, "service_tier": "auto"}, timeout=30)
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
