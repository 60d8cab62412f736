"""Tier targets that fit the model (issue 17, part 9), on SmolLM2-135M-Instruct: a priority
request an idle server is about to run is never refused, whatever the model's prefill costs,
and under load a refusal is about the wait the queue adds, never the request's own prefill."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from ultrafast.config import ServerConfig
from ultrafast.engine.idle_speed import TYPICAL_PROMPT_TOKENS
from ultrafast_harness.bench.server_process import ServerProcess

WORDS = ("apple", "river", "stone", "cloud", "green", "seven", "table", "light", "north", "paper")


def prompt_of_about_100_tokens(seed: int) -> str:
    """Distinct from the first word on, so no request finds another's prefix cached."""
    words = [WORDS[(seed * 7 + i * i) % len(WORDS)] for i in range(90)]
    return f"Request {seed}: " + " ".join(words)


@pytest.fixture(scope="module")
def smollm2_server():
    from tests.model.gguf_files import require_smollm2

    # no --priority-ttft-ms: the targets come from the speed measured at start
    srv = ServerProcess("--spec", "off", model=require_smollm2(), max_model_len=1024)
    yield srv
    srv.stop()


def priority_chat(url: str, seed: int) -> httpx.Response:
    return httpx.post(
        url + "/v1/chat/completions",
        timeout=120,
        json={
            "messages": [{"role": "user", "content": prompt_of_about_100_tokens(seed)}],
            "max_tokens": 4,
            "temperature": 0,
            "service_tier": "priority",
        },
    )


@pytest.mark.real_model
def test_the_targets_come_from_the_measured_speed(smollm2_server):
    ready = httpx.get(smollm2_server.url + "/ready", timeout=10).json()
    speed, priority = ready["idle_speed"], ready["tier_targets"]["priority"]
    assert speed["prompt_tokens"] == TYPICAL_PROMPT_TOKENS
    assert speed["ttft_ms"] > 0 and speed["decode_ms"] > 0
    assert priority["ttft_source"] in ("measured", "floor")
    rule = ServerConfig.priority
    expected_ms = max(rule.ttft_floor_ms, rule.ttft_speed_factor * speed["ttft_ms"])
    assert priority["ttft_ms"] == pytest.approx(expected_ms, rel=1e-3)


@pytest.mark.real_model
def test_five_lone_priority_requests_on_an_idle_server_all_run(smollm2_server):
    for seed in range(5):
        r = priority_chat(smollm2_server.url, seed)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["service_tier"] == "priority"
        assert 80 <= body["usage"]["prompt_tokens"] <= 160  # about 100 tokens, chat-wrapped


@pytest.mark.real_model
def test_under_a_default_burst_priority_is_admitted_or_refused_for_the_queue(smollm2_server):
    url = smollm2_server.url
    statuses: list[int] = []

    def default_call(seed: int) -> None:
        r = httpx.post(
            url + "/v1/completions",
            timeout=300,
            json={"prompt": prompt_of_about_100_tokens(100 + seed), "max_tokens": 48},
        )
        statuses.append(r.status_code)

    burst = [threading.Thread(target=default_call, args=(i,)) for i in range(6)]
    for t in burst:
        t.start()
    deadline = time.monotonic() + 120
    while httpx.get(url + "/ready", timeout=10).json()["running"] < 2:
        assert time.monotonic() < deadline, "the default burst never ran"
        time.sleep(0.02)
    r = priority_chat(url, 99)
    for t in burst:
        t.join(300)
    assert statuses == [200] * 6
    if r.status_code == 200:
        assert r.json()["service_tier"] == "priority"
    else:
        assert r.status_code == 429, r.text
        err = r.json()["error"]
        assert err["code"] == "priority_slo_unattainable"
        # the wait the queue adds is what misses the target, not the request's own prefill
        own_ms = err["predicted_ttft_ms"] - err["queue_wait_ms"]
        assert err["queue_wait_ms"] > err["target_ttft_ms"] - own_ms
        assert err["queue_wait_ms"] > 0 and "queued ahead" in err["message"]
