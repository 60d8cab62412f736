"""A key's `default_tier` in the keys file (server/tenants.py): a call that names no tier runs
on it, on every protocol: OpenAI chat completions and Responses without `service_tier`,
Anthropic Messages without one or with `auto`, Ollama chat. A tier the call names still wins,
and a key without a default keeps today's behaviour."""

from __future__ import annotations

import httpx
import pytest
import yaml

from tests.e2e.metric_samples import scrape_metrics
from ultrafast.server.tenants import hash_key
from ultrafast_harness.bench.server_process import ServerProcess

MODEL = "demo-code"
KEYS = {
    "gold-fast": "dt-gold-fast",
    "gold-std": "dt-gold-std",
    "gold": "dt-gold",
    "lite": "dt-lite",
}
ASK = [{"role": "user", "content": "def add(a, b):"}]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("default-tier")
    gold = [
        {"sha256": hash_key(KEYS["gold-fast"]), "default_tier": "priority"},
        {"sha256": hash_key(KEYS["gold-std"]), "default_tier": "default"},
        {"sha256": hash_key(KEYS["gold"])},
    ]
    spec = {
        "tenants": [
            {
                "name": "gold",
                "tiers": ["priority", "default", "flex"],
                "scopes": ["inference", "metrics"],
                "keys": gold,
            },
            {
                "name": "lite",
                "tiers": ["default", "flex"],
                "keys": [{"sha256": hash_key(KEYS["lite"]), "default_tier": "flex"}],
            },
        ]
    }
    (tmp / "keys.yaml").write_text(yaml.safe_dump(spec))
    server = ServerProcess("--api-keys", str(tmp / "keys.yaml"), "--priority-ttft-ms", "10000")
    yield server
    server.stop()


def bearer(who: str) -> dict:
    return {"Authorization": f"Bearer {KEYS[who]}"}


def chat_tier(srv, who: str, **extra) -> str:
    body = {"model": MODEL, "messages": ASK, "max_tokens": 2, "temperature": 0, **extra}
    r = httpx.post(srv.url + "/v1/chat/completions", json=body, headers=bearer(who), timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["service_tier"]


def test_openai_calls_naming_no_tier_run_on_the_keys_default(srv):
    assert chat_tier(srv, "gold-fast") == "priority"
    assert chat_tier(srv, "lite") == "flex"
    assert chat_tier(srv, "gold") == "default"  # no default_tier: as before
    assert chat_tier(srv, "gold-fast", service_tier="default") == "default"  # named wins
    body = {"model": MODEL, "input": ASK, "max_output_tokens": 2, "store": False}
    r = httpx.post(srv.url + "/v1/responses", json=body, headers=bearer("lite"), timeout=60)
    assert r.status_code == 200 and r.json()["service_tier"] == "flex", r.text


def messages_tier(srv, who: str, **extra) -> str:
    body = {"model": MODEL, "messages": ASK, "max_tokens": 2, **extra}
    headers = {"x-api-key": KEYS[who], "anthropic-version": "2023-06-01"}
    r = httpx.post(srv.url + "/v1/messages", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["service_tier"]


def test_anthropic_absent_or_auto_runs_on_the_keys_default(srv):
    assert messages_tier(srv, "gold-fast") == "priority"
    assert messages_tier(srv, "gold-std", service_tier="auto") == "standard"
    assert messages_tier(srv, "gold", service_tier="auto") == "priority"  # no default: as before


def scrape(srv) -> dict:
    return scrape_metrics(srv.url, bearer("gold"))


def test_ollama_chat_runs_on_the_keys_default(srv):
    body = {"model": MODEL, "messages": ASK, "stream": False, "options": {"num_predict": 2}}
    served = {}
    for who in ("gold-fast", "lite"):
        before = scrape(srv)
        r = httpx.post(srv.url + "/api/chat", json=body, headers=bearer(who), timeout=60)
        assert r.status_code == 200, r.text
        after = scrape(srv)
        served[who] = [
            tier
            for tier in ("priority", "default", "flex")
            if after[("ultrafast_e2e_request_latency_seconds_count", (("tier", tier),))]
            > before.get(("ultrafast_e2e_request_latency_seconds_count", (("tier", tier),)), 0)
        ]
    assert served == {"gold-fast": ["priority"], "lite": ["flex"]}
