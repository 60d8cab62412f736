"""One call pipeline under four protocols (issue 33, item 4): the same prompt through chat
completions, the Responses API, Anthropic Messages and Ollama chat gives the same greedy
tokens; a tenant not entitled to priority gets each protocol's own 403; and the second call
reads the prompt from the prefix cache whichever protocol made the first."""

from __future__ import annotations

import httpx
import pytest
import yaml

from ultrafast.server.tenants import hash_key
from ultrafast_harness.bench.server_process import ServerProcess

KEYS = {"acme": "pipe-acme-key", "beta": "pipe-beta-key", "gamma": "pipe-gamma-key"}
MODEL = "demo-code"
PROTOCOLS = ("chat", "responses", "anthropic", "ollama")
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pipeline")
    spec = {
        "tenants": [
            {
                "name": "acme",
                "keys": [{"sha256": hash_key(KEYS["acme"])}],
                "tiers": ["priority", "default"],
            },
            {"name": "beta", "keys": [{"sha256": hash_key(KEYS["beta"])}]},
            {"name": "gamma", "keys": [{"sha256": hash_key(KEYS["gamma"])}], "tiers": ["flex"]},
        ]
    }
    (tmp / "keys.yaml").write_text(yaml.safe_dump(spec))
    server = ServerProcess(
        "--api-keys",
        str(tmp / "keys.yaml"),
        "--priority-ttft-ms",
        "10000",
        "--session-store",
        f"sqlite:///{tmp}/sessions.db",
        max_model_len=1024,
    )
    yield server
    server.stop()


def call(
    srv, protocol: str, text: str, tenant: str = "acme", tier: str | None = None
) -> httpx.Response:
    """One greedy call; the Anthropic route gets its key as `x-api-key`, the rest as Bearer."""
    key = KEYS[tenant]
    bearer = {"Authorization": f"Bearer {key}"}
    messages = [{"role": "user", "content": text}]
    tiered = {} if tier is None else {"service_tier": tier}
    if protocol == "chat":
        body = {"model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
        return httpx.post(
            srv.url + "/v1/chat/completions", json={**body, **tiered}, headers=bearer, timeout=60
        )
    if protocol == "responses":
        body = {
            "model": MODEL,
            "input": messages,
            "max_output_tokens": MAX_TOKENS,
            "temperature": 0,
            "store": False,
        }
        return httpx.post(
            srv.url + "/v1/responses", json={**body, **tiered}, headers=bearer, timeout=60
        )
    if protocol == "anthropic":
        body = {"model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
        headers = {"x-api-key": key, "anthropic-version": "2023-06-01"}
        return httpx.post(
            srv.url + "/v1/messages", json={**body, **tiered}, headers=headers, timeout=60
        )
    body = {
        "model": MODEL + ":latest",
        "messages": messages,
        "stream": False,
        "options": {"temperature": 0, "num_predict": MAX_TOKENS},
    }
    return httpx.post(srv.url + "/api/chat", json={**body, **tiered}, headers=bearer, timeout=60)


def text_and_cached(protocol: str, r: httpx.Response) -> tuple[str, int, int]:
    """(answer, prompt tokens, of which read from the prefix cache) as each protocol says it."""
    assert r.status_code == 200, r.text
    b = r.json()
    if protocol == "chat":
        u = b["usage"]
        return (
            b["choices"][0]["message"]["content"],
            u["prompt_tokens"],
            u["prompt_tokens_details"]["cached_tokens"],
        )
    if protocol == "responses":
        u = b["usage"]
        text = b["output"][0]["content"][0]["text"]
        return text, u["input_tokens"], u["input_tokens_details"]["cached_tokens"]
    if protocol == "anthropic":
        u = b["usage"]
        total = u["input_tokens"] + u["cache_read_input_tokens"]
        return b["content"][0]["text"], total, u["cache_read_input_tokens"]
    return b["message"]["content"], -1, -b["prompt_eval_count"]  # evaluated = prompt - cached


def test_same_greedy_tokens_through_every_protocol(srv):
    answers = {p: text_and_cached(p, call(srv, p, "def add(a, b):"))[0] for p in PROTOCOLS}
    assert answers["chat"]
    assert set(answers.values()) == {answers["chat"]}, answers


# each protocol makes the first call once and the second call once
ROTATION = list(zip(PROTOCOLS, PROTOCOLS[1:] + PROTOCOLS[:1]))


@pytest.mark.parametrize("first, second", ROTATION)
def test_prefix_cache_hit_whichever_protocol_came_first(srv, first, second):
    text = f"# {first} then {second}\nclass Point:"  # a prompt no other test sent
    _, num_prompt, _ = text_and_cached(first, call(srv, first, text))
    _, _, cached = text_and_cached(second, call(srv, second, text))
    if second == "ollama":  # Ollama reports the prompt tokens it evaluated: fewer than all
        assert 0 < -cached < num_prompt
    else:
        assert cached > 0


def test_priority_is_refused_in_each_protocols_own_shape(srv):
    for protocol in PROTOCOLS:
        r = call(srv, protocol, "def f():", tenant="beta", tier="priority")
        assert r.status_code == 403, (protocol, r.text)
        body = r.json()
        if protocol == "anthropic":
            assert body["type"] == "error" and body["error"]["type"] == "permission_error"
        elif protocol == "ollama":
            assert set(body) == {"error"} and "priority" in body["error"]
        else:
            assert body["error"]["type"] == "permission_error"
            assert body["error"]["code"] == "priority_not_allowed"
        ok = call(srv, protocol, "def f():", tenant="acme", tier="priority")
        assert ok.status_code == 200 and ok.headers["x-service-tier"] == "priority", protocol


def test_keys_are_checked_on_every_protocol_in_its_shape(srv):
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}
    r = httpx.post(srv.url + "/v1/messages", json=body, headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(srv.url + "/api/chat", json={"model": MODEL, "messages": []})
    assert r.status_code == 401 and set(r.json()) == {"error"}
    assert httpx.get(srv.url + "/api/tags").status_code == 401


@pytest.mark.parametrize("protocol", ["anthropic", "ollama"])
def test_no_tier_named_is_the_keys_default_tier(srv, protocol):
    r = call(srv, protocol, "def g():", tenant="gamma")
    assert r.status_code == 200 and r.headers["x-service-tier"] == "flex", r.text
    assert call(srv, protocol, "def g():", tenant="beta").headers["x-service-tier"] == "default"
