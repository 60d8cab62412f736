"""The real server with `--api-keys`: docs/RELIABILITY.md B41, B45-B49, S1 (route census),
S2 (no key in logs), S4 (prefix cache per tenant), S9 (no CORS, Host allow-list), S10 (loopback
without keys), S12 (label cardinality), rate limits (429 + Retry-After), and /metrics after real
traffic. Driven with the official openai client and raw httpx.
"""

from __future__ import annotations

import subprocess
import sys

import httpx
import openai
import pytest
import yaml
from starlette.testclient import TestClient

from tests.e2e.metric_samples import scrape_metrics
from ultrafast.config import ServerConfig
from ultrafast.server.admission import Admission
from ultrafast.server.app import ServerState, build_app
from ultrafast.server.runtime import ModelRuntime, ModelSet
from ultrafast.server.tenants import hash_key, parse_api_keys
from ultrafast_harness.bench.server_process import ServerProcess

KEYS = {
    "acme": "e2e-acme-key",
    "beta": "e2e-beta-key",
    "off": "e2e-off-key",
    "ops": "e2e-ops-key",
    "slow": "e2e-slow-key",
    "thin": "e2e-thin-key",
    "old": "e2e-revoked-key",
}
BODY = {
    "messages": [{"role": "user", "content": "def add(a, b):"}],
    "max_tokens": 4,
    "temperature": 0,
}
CHAT = "/v1/chat/completions"


def keys_file_spec() -> dict:
    def tenant(name, **fields):
        return {"name": name, "keys": [{"sha256": hash_key(KEYS[name])}], **fields}

    acme = tenant("acme", tiers=["priority", "default", "flex"], committed_priority_share=0.25)
    acme["keys"].append({"sha256": hash_key(KEYS["old"]), "revoked": True})
    return {
        "tenants": [
            acme,
            tenant("beta"),
            tenant("off", disabled=True),
            tenant("ops", scopes=["metrics"]),
            tenant("slow", requests_per_s=0.05),
            tenant("thin", tokens_per_s=20),
        ]
    }


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.yaml"
    path.write_text(yaml.safe_dump(keys_file_spec()))
    srv = ServerProcess("--api-keys", str(path), "--priority-ttft-ms", "10000")
    yield srv
    srv.stop()


def bearer(name: str) -> dict:
    return {"Authorization": f"Bearer {KEYS[name]}"}


def error_of(r: httpx.Response) -> tuple:
    body = r.json()
    assert set(body["error"]) >= {"message", "type", "param", "code"}, body
    assert "x-request-id" in r.headers
    for key in KEYS.values():
        assert key not in r.text
    e = body["error"]
    return r.status_code, e["type"], e["code"], e["param"]


CASES = {
    "B41 priority without entitlement": (
        dict(headers=bearer("beta"), json={**BODY, "priority": "ultrafast"}),
        (403, "permission_error", "priority_not_allowed", "priority"),
    ),
    "B41 via service_tier": (
        dict(headers=bearer("beta"), json={**BODY, "service_tier": "priority"}),
        (403, "permission_error", "priority_not_allowed", "service_tier"),
    ),
    "B45 no key": (dict(json=BODY), (401, "authentication_error", "missing_api_key", None)),
    "B46 wrong key": (
        dict(headers={"Authorization": "Bearer nope"}, json=BODY),
        (401, "authentication_error", "invalid_api_key", None),
    ),
    "B46 Bearer twice": (
        dict(headers={"Authorization": f"Bearer Bearer {KEYS['acme']}"}, json=BODY),
        (401, "authentication_error", "invalid_api_key", None),
    ),
    "B46 Basic": (
        dict(headers={"Authorization": "Basic YWNtZTp4"}, json=BODY),
        (401, "authentication_error", "invalid_api_key", None),
    ),
    "B46 key in query": (
        dict(params={"api_key": KEYS["acme"]}, json=BODY),
        (401, "authentication_error", "invalid_api_key", None),
    ),
    "B46 revoked": (
        dict(headers=bearer("old"), json=BODY),
        (401, "authentication_error", "invalid_api_key", None),
    ),
    "B47 suspended": (
        dict(headers=bearer("off"), json=BODY),
        (403, "permission_error", "tenant_disabled", None),
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_auth_rows(keyed, case):
    kwargs, expected = CASES[case]
    r = httpx.post(keyed.url + CHAT, timeout=30, **kwargs)
    assert error_of(r) == expected
    if r.status_code == 401:
        assert r.headers["www-authenticate"] == "Bearer"


def test_b48_method_and_b49_unknown_path(keyed):
    r = httpx.get(keyed.url + CHAT)
    assert error_of(r)[:3] == (401, "authentication_error", "missing_api_key")
    # GET /v1/chat/completions lists stored completions: the method check uses completions
    r = httpx.get(keyed.url + "/v1/completions", headers=bearer("acme"))
    assert error_of(r)[:3] == (405, "invalid_request_error", "method_not_allowed")
    assert r.headers["allow"] == "POST"
    r = httpx.get(keyed.url + "/v1/secret-admin")
    assert r.status_code == 401  # auth before routing: paths cannot be enumerated
    r = httpx.get(keyed.url + "/v1/secret-admin", headers=bearer("acme"))
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_valid_keys_are_served_with_the_openai_client(keyed):
    client = openai.OpenAI(base_url=keyed.url + "/v1", api_key=KEYS["acme"], max_retries=0)
    out = client.chat.completions.create(model="demo-code", service_tier="priority", **BODY)
    assert out.service_tier == "priority" and out.usage.completion_tokens == 4
    beta = openai.OpenAI(base_url=keyed.url + "/v1", api_key=KEYS["beta"], max_retries=0)
    auto = beta.chat.completions.create(model="demo-code", service_tier="auto", **BODY)
    assert auto.service_tier == "default"  # no priority entitlement: auto never picks it
    with pytest.raises(openai.PermissionDeniedError):
        beta.chat.completions.create(model="demo-code", service_tier="priority", **BODY)
    bad = openai.OpenAI(base_url=keyed.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_rate_limits_give_429_with_retry_after(keyed):
    ok = httpx.post(keyed.url + CHAT, headers=bearer("slow"), json=BODY, timeout=30)
    assert ok.status_code == 200, ok.text
    r = httpx.post(keyed.url + CHAT, headers=bearer("slow"), json=BODY, timeout=30)
    assert error_of(r)[:3] == (429, "rate_limit_error", "rate_limit_exceeded")
    assert int(r.headers["retry-after"]) >= 1
    # tokens/s: prompt + max_tokens are reserved; a full bucket lets one big call through
    big = {**BODY, "max_tokens": 30, "ignore_eos": True}
    assert (
        httpx.post(keyed.url + CHAT, headers=bearer("thin"), json=big, timeout=30).status_code
        == 200
    )
    r = httpx.post(keyed.url + CHAT, headers=bearer("thin"), json=big, timeout=30)
    assert error_of(r)[:3] == (429, "rate_limit_error", "rate_limit_exceeded")
    assert int(r.headers["retry-after"]) >= 1


def app_routes():
    """Every (method, path) the real ASGI app routes, built with a keys file."""
    model = ModelRuntime("m", None, 8, None, Admission(ServerConfig()))
    state = ServerState(
        config=ServerConfig(),
        models=ModelSet([model]),
        api_keys=parse_api_keys(keys_file_spec()),
    )
    app = build_app(state)
    pairs = []
    for route in app.routes:
        for method in sorted(getattr(route, "methods", None) or {"GET"}):
            if method != "HEAD":
                pairs.append((method, route.path))
    return app, pairs


def missing_key_refusal(path: str, body: dict) -> bool:
    """The 401 in the shape of the route's protocol (server/frontends/)."""
    if path.startswith("/v1/messages"):  # Anthropic's
        return body["type"] == "error" and body["error"]["type"] == "authentication_error"
    if path.startswith("/api/"):  # Ollama's
        return "missing API key" in body["error"]
    return body["error"]["code"] == "missing_api_key"


def test_s1_route_census_every_route_but_health_and_the_page_needs_a_key(keyed):
    app, pairs = app_routes()
    assert ("GET", "/metrics") in pairs and ("GET", "/health") in pairs
    assert len(pairs) >= 8
    local = TestClient(app, base_url="http://127.0.0.1", raise_server_exceptions=False)
    for method, path in pairs:
        for client, base in ((local, ""), (httpx, keyed.url)):
            r = client.request(
                method,
                base + path.replace("{", "x").replace("}", ""),
                json={} if method == "POST" else None,
            )
            if (method, path) in (("GET", "/health"), ("GET", "/")):  # the page asks for a key
                assert r.status_code == 200
            else:
                assert r.status_code == 401, (method, path, r.status_code)
                assert missing_key_refusal(path, r.json()), (path, r.text)
    for extra in ("/docs", "/openapi.json", "/admin", "/ready"):
        assert httpx.get(keyed.url + extra).status_code == 401
    assert httpx.post(keyed.url + "/").status_code == 401  # only GET / is open


def test_metrics_need_the_metrics_scope(keyed):
    assert httpx.get(keyed.url + "/metrics").status_code == 401
    r = httpx.get(keyed.url + "/metrics", headers=bearer("acme"))
    assert error_of(r)[:3] == (403, "permission_error", "scope_not_allowed")
    r = httpx.get(keyed.url + "/metrics", headers=bearer("ops"))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")


def scrape(srv) -> dict:
    return scrape_metrics(srv.url, bearer("ops"))


def test_metrics_after_real_traffic(keyed):
    client = openai.OpenAI(base_url=keyed.url + "/v1", api_key=KEYS["acme"], max_retries=0)
    before = scrape(keyed)
    stream = client.chat.completions.create(
        model="demo-code", service_tier="priority", stream=True, **{**BODY, "max_tokens": 8}
    )
    assert len([c for c in stream if c.choices and c.choices[0].delta.content]) > 1
    httpx.post(keyed.url + CHAT, json=BODY)  # a 401, counted by reason
    after = scrape(keyed)

    def grew(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0)

    assert grew("ultrafast_time_to_first_token_seconds_count", tier="priority") == 1
    assert grew("ultrafast_e2e_request_latency_seconds_count", tier="priority") == 1
    assert grew("ultrafast_inter_token_latency_seconds_count", tier="priority") >= 5
    assert grew("ultrafast_generation_tokens_total", tenant="acme") == 8
    assert grew("ultrafast_prompt_tokens_total", tenant="acme") > 0
    assert grew("ultrafast_admissions_refused_total", reason="missing_api_key") == 1
    # the priority tier drafts (speculative decoding), so one step may release several of the
    # 8 tokens: at least the prefill step and one decode step ran
    assert grew("ultrafast_step_phase_seconds_count", phase="execute") >= 2
    assert after[("ultrafast_kv_slots_total", ())] == 4
    assert after[("ultrafast_engine_info", (("device_kind", "cpu"),))] == 1


def test_s12_request_fields_never_become_labels(keyed):
    before = set(scrape(keyed))
    with httpx.Client(base_url=keyed.url, headers=bearer("acme"), timeout=30) as c:
        for i in range(300):
            r = c.post(CHAT, json={**BODY, "model": f"model-{i}", "user": f"user-{i}"})
            assert r.status_code == 404
        for i in range(50):
            c.post(CHAT, headers={"Authorization": f"Bearer random-{i}"}, json=BODY)
    assert set(scrape(keyed)) == before


def test_s4_prefix_cache_is_per_tenant(keyed):
    prompt = "class Stack:\n" + "    x = 1\n" * 12
    body = {**BODY, "messages": [{"role": "user", "content": prompt}]}
    for _ in range(2):
        acme = httpx.post(keyed.url + CHAT, headers=bearer("acme"), json=body, timeout=30).json()
    assert acme["usage"]["prompt_tokens"] > 32
    assert acme["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    beta = httpx.post(keyed.url + CHAT, headers=bearer("beta"), json=body, timeout=30).json()
    assert beta["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_s9_no_cors_and_a_host_allow_list(keyed):
    origin = {"Origin": "http://evil.example"}
    r = httpx.post(keyed.url + CHAT, headers={**bearer("acme"), **origin}, json=BODY, timeout=30)
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    r = httpx.options(keyed.url + CHAT, headers={**origin, "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in r.headers
    rebound = httpx.post(
        keyed.url + CHAT, headers={**bearer("acme"), "Host": "evil.example"}, json=BODY
    )
    assert error_of(rebound)[:3] == (403, "permission_error", "host_not_allowed")
    port = keyed.url.rsplit(":", 1)[1]
    named = httpx.get(keyed.url + "/health", headers={"Host": f"localhost:{port}"})
    assert named.status_code == 200


def test_realtime_websocket_needs_a_key_and_an_allowed_host(keyed):
    """The WebSocket route is behind the same checks as HTTP: a browser page on another origin
    (DNS rebinding) or a caller without a key never reaches the conversation."""
    import json
    import socket

    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    ws_url = keyed.url.replace("http://", "ws://") + "/v1/realtime"
    for headers in ({}, {"Authorization": "Bearer nope"}):
        with pytest.raises(InvalidStatus) as refused:
            with connect(ws_url, additional_headers=headers, open_timeout=10):
                pass
        assert refused.value.response.status_code == 403, headers
    host, port = keyed.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as raw:  # a rebound name
        raw.sendall(
            b"GET /v1/realtime HTTP/1.1\r\nHost: evil.example\r\nUpgrade: websocket\r\n"
            b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
            b"Sec-WebSocket-Version: 13\r\nAuthorization: Bearer "
            + KEYS["acme"].encode()
            + b"\r\n\r\n"
        )
        assert raw.recv(4096).split(b"\r\n")[0].split(b" ")[1] == b"403"
    with connect(ws_url, additional_headers=bearer("acme"), open_timeout=10) as ws:
        assert json.loads(ws.recv(timeout=30))["type"] == "session.created"


def test_s3_sessions_of_one_tenant_are_invisible_to_another(keyed):
    """docs/RELIABILITY.md S3 / B44: another tenant's conversation, response or chat session
    is 404."""
    client = {
        name: openai.OpenAI(base_url=keyed.url + "/v1", api_key=KEYS[name], max_retries=0)
        for name in ("acme", "beta")
    }
    conversation = client["acme"].conversations.create()
    response = client["acme"].responses.create(
        model="demo-code", input="def add(a, b):", max_output_tokens=4, temperature=0
    )
    assert client["acme"].conversations.retrieve(conversation.id).id == conversation.id
    assert client["acme"].responses.retrieve(response.id).id == response.id
    beta = client["beta"]
    for attempt in (
        lambda: beta.conversations.retrieve(conversation.id),
        lambda: beta.conversations.delete(conversation.id),
        lambda: beta.conversations.items.list(conversation.id),
        lambda: beta.responses.retrieve(response.id),
        lambda: beta.responses.delete(response.id),
        lambda: beta.responses.create(
            model="demo-code", input="x", previous_response_id=response.id, max_output_tokens=2
        ),
    ):
        with pytest.raises(openai.NotFoundError):
            attempt()
    # a chat `session_id` names a session in the caller's own tenant (created on first use, as
    # for any unknown id): beta gets a fresh one and acme's history is neither read nor changed
    acme_items = client["acme"].conversations.items.list(conversation.id).data
    seed = client["acme"].chat.completions.create(
        model="demo-code",
        messages=[{"role": "user", "content": "def acme_secret():"}],
        max_tokens=2,
        temperature=0,
        extra_body={"session_id": conversation.id},
    )
    alone = beta.chat.completions.create(
        model="demo-code",
        messages=[{"role": "user", "content": "x"}],
        max_tokens=2,
        temperature=0,
        extra_body={"session_id": conversation.id},
    )
    fresh = beta.chat.completions.create(
        model="demo-code", messages=[{"role": "user", "content": "x"}], max_tokens=2, temperature=0
    )
    assert alone.usage.prompt_tokens == fresh.usage.prompt_tokens < seed.usage.prompt_tokens
    assert (
        len(client["acme"].conversations.items.list(conversation.id).data) == len(acme_items) + 2
    )  # acme's own turn and answer, nothing of beta's


def test_s3_stored_chat_completions_of_one_tenant_are_invisible_to_another(keyed):
    client = {
        name: openai.OpenAI(base_url=keyed.url + "/v1", api_key=KEYS[name], max_retries=0)
        for name in ("acme", "beta")
    }
    stored = client["acme"].chat.completions.create(
        model="demo-code", store=True, metadata={"who": "acme"}, **BODY
    )
    assert client["acme"].chat.completions.retrieve(stored.id).id == stored.id
    beta = client["beta"]
    for attempt in (
        lambda: beta.chat.completions.retrieve(stored.id),
        lambda: beta.chat.completions.delete(stored.id),
        lambda: beta.chat.completions.messages.list(stored.id),
    ):
        with pytest.raises(openai.NotFoundError):
            attempt()
    assert list(beta.chat.completions.list(metadata={"who": "acme"})) == []
    assert [c.id for c in client["acme"].chat.completions.list(metadata={"who": "acme"})] == [
        stored.id
    ]


def test_s2_keys_never_reach_the_logs(keyed):  # stops the server: keep it last but one
    httpx.post(keyed.url + CHAT, headers={"Authorization": "Bearer leaked-in-logs?"}, json=BODY)
    keyed.stop()
    output = keyed.output()
    assert "auth failed" in output  # failures are logged...
    for key in [*KEYS.values(), "leaked-in-logs"]:
        assert key not in output  # ...without the key


def test_s10_no_keys_means_loopback_only():
    r = subprocess.run(
        [sys.executable, "-m", "ultrafast.cli", "serve", "--host", "0.0.0.0", "--port", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2
    assert "without --api-keys" in r.stderr and "loopback" in r.stderr
