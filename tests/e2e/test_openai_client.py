"""The real server on the demo model, driven by the official `openai` client and raw HTTP."""

from __future__ import annotations

import json
import socket
import time

import httpx
import openai
import pytest


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def wait_idle(server, timeout_s=10):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = httpx.get(server.url + "/ready").json()
        if (
            state["running"] == 0
            and state["kv_slots_busy"] == 0
            and not any(state["in_flight"].values())
        ):
            return state
        time.sleep(0.05)
    raise AssertionError(f"engine not idle: {state}")


def test_models_lists_the_demo_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["demo-code"]


def test_chat_stream_equals_non_stream_at_temperature_zero(client, server):
    messages = [{"role": "user", "content": "def fibonacci(n):"}]
    full = client.chat.completions.create(
        model="demo-code", messages=messages, max_tokens=24, temperature=0
    )
    assert full.object == "chat.completion" and full.service_tier == "default"
    assert full.usage.completion_tokens == 24 and full.choices[0].finish_reason == "length"
    chunks = list(
        client.chat.completions.create(
            model="demo-code",
            messages=messages,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 24
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    # the same prompt again reuses its cached prefix
    again = client.chat.completions.create(
        model="demo-code", messages=messages, max_tokens=4, temperature=0
    )
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    wait_idle(server)


@pytest.mark.parametrize(
    "tier,served",
    [
        ("priority", "priority"),
        ("ultrafast", "priority"),
        ("flex", "flex"),
        ("default", "default"),
        ("auto", "priority"),
    ],
)
def test_service_tier_is_echoed(server, tier, served):
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "x = 1"}],
            "max_tokens": 2,
            "service_tier": tier,
        },
        timeout=30,
    )
    assert r.status_code == 200, r.text
    assert r.json()["service_tier"] == served and r.headers["x-service-tier"] == served
    assert "ttft;dur=" in r.headers["server-timing"] and float(r.headers["x-queue-wait-ms"]) >= 0


def test_completions_n_seed_logprobs_and_stop(client):
    out = client.completions.create(
        model="demo-code",
        prompt="import os\n",
        max_tokens=12,
        n=3,
        temperature=1.0,
        seed=11,
        logprobs=2,
    )
    assert len(out.choices) == 3 and {c.index for c in out.choices} == {0, 1, 2}
    again = client.completions.create(
        model="demo-code",
        prompt="import os\n",
        max_tokens=12,
        n=3,
        temperature=1.0,
        seed=11,
        logprobs=2,
    )
    assert [c.text for c in out.choices] == [c.text for c in again.choices]  # seeded
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 12
    assert all(v <= 0 for v in lp.token_logprobs) and all(len(t) <= 2 for t in lp.top_logprobs)
    greedy = (
        client.completions.create(
            model="demo-code", prompt="def f(x):\n", max_tokens=20, temperature=0
        )
        .choices[0]
        .text
    )
    assert len(greedy) > 2
    stop = greedy[1:3]
    cut = client.completions.create(
        model="demo-code", prompt="def f(x):\n", max_tokens=20, temperature=0, stop=[stop]
    )
    assert cut.choices[0].text == greedy[: greedy.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_chat_logprobs(client):
    out = client.chat.completions.create(
        model="demo-code",
        max_tokens=5,
        temperature=0,
        messages=[{"role": "user", "content": "class A:"}],
        logprobs=True,
        top_logprobs=3,
    )
    content = out.choices[0].logprobs.content
    assert len(content) == 5 and all(len(c.top_logprobs) == 3 for c in content)
    assert content[0].top_logprobs[0].logprob >= content[0].top_logprobs[1].logprob


def test_completion_with_token_ids_and_batch_of_prompts(server):
    ids = httpx.post(server.url + "/tokenize", json={"prompt": "def main():"}).json()["tokens"]
    text = httpx.post(server.url + "/detokenize", json={"tokens": ids}).json()["prompt"]
    assert text == "def main():"
    r = httpx.post(
        server.url + "/v1/completions",
        json={"prompt": [ids, "import sys"], "max_tokens": 3, "temperature": 0, "echo": True},
        timeout=30,
    ).json()
    assert len(r["choices"]) == 2 and r["choices"][0]["text"].startswith("def main():")


def generated_tokens(server) -> float:
    """The server's output-token counter, summed over tenants."""
    total = 0.0
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith("ultrafast_generation_tokens_total"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_client_disconnect_frees_the_slot(server):
    with httpx.stream(
        "POST",
        server.url + "/v1/completions",
        json={"prompt": "def a():", "max_tokens": 400, "stream": True, "ignore_eos": True},
        timeout=30,
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                break  # one token received, then hang up
    wait_idle(server, timeout_s=5)
    # non-streaming: the client hangs up once the run is under way (raw socket, so the moment
    # does not depend on how fast this machine decodes); the run must stop early, not finish
    before = generated_tokens(server)
    body = json.dumps(
        {"prompt": "def b():", "max_tokens": 500, "n": 4, "ignore_eos": True}
    ).encode()
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
            % host.encode()
            + b"Content-Length: %d\r\n\r\n" % len(body)
            + body
        )
        deadline = time.monotonic() + 10
        while httpx.get(server.url + "/ready").json()["running"] == 0:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.005)
    wait_idle(server, timeout_s=10)
    assert generated_tokens(server) - before < 4 * 500  # aborted, not run to the end


def raw(server, body, headers=None, method="POST", path="/v1/chat/completions"):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.request(
        method,
        server.url + path,
        content=data,
        timeout=30,
        headers={"Content-Type": "application/json", **(headers or {})},
    )


def assert_error(r, status, code, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    assert err["code"] == code and err["param"] == param
    assert "Traceback" not in r.text and "/ultrafast/" not in r.text
    assert r.headers.get("x-request-id")


def test_bad_inputs_over_http(server):
    msg = [{"role": "user", "content": "hi"}]
    assert_error(raw(server, b'{"model":'), 400, "invalid_json")
    assert_error(raw(server, b"{}", {"Content-Type": "text/plain"}), 415, "unsupported_media_type")
    assert_error(raw(server, b"{" + b" " * (4 * 1024 * 1024 + 10) + b"}"), 413, "payload_too_large")
    assert_error(raw(server, {"messages": msg, "model": "nope"}), 404, "model_not_found", "model")
    assert_error(
        raw(server, {"messages": msg, "max_tokens": "100"}), 400, "invalid_type", "max_tokens"
    )
    assert_error(
        raw(server, {"prompt": [10**6]}, path="/v1/completions"), 400, "invalid_value", "prompt"
    )
    long = [{"role": "user", "content": "x = 1\n" * 600}]
    for _ in range(3):  # B25, three times in a row: still refused, still up
        assert_error(raw(server, {"messages": long}), 400, "context_length_exceeded", "messages")
    assert_error(
        raw(server, {"messages": msg, "max_tokens": 4000}),
        400,
        "context_length_exceeded",
        "max_tokens",
    )
    r = raw(server, b"", method="GET", path="/v1/completions")  # GET chat/completions: a list
    assert_error(r, 405, "method_not_allowed")
    assert r.headers["allow"] == "POST"
    assert httpx.get(server.url + "/health").status_code == 200


def test_chunked_oversized_body_is_refused_while_streaming(server):
    def chunks():
        for _ in range(5 * 1024):
            yield b" " * 1024

    r = httpx.post(
        server.url + "/v1/chat/completions",
        content=chunks(),
        timeout=30,
        headers={"Content-Type": "application/json"},
    )
    assert_error(r, 413, "payload_too_large")
