"""/v1/embeddings and /api/embed (B80-B82) over the real app, state and embedding engine,
with a fake executor: input forms, float/base64, dimensions, usage, and every bad input in
each protocol's own error shape with the exact field (never a 500)."""

import base64
from dataclasses import replace

import numpy as np
import pytest
from starlette.testclient import TestClient

from tests.unit.fake_embedder import CLS, SEP, FakeEmbedExecutor, vector
from ultrafast.config import ServerConfig
from ultrafast.engine.embed_engine import EmbeddingEngine
from ultrafast.server.app import build_app
from ultrafast.server.embed_models import embedding_only_state
from ultrafast.server.runtime import ModelSet

LOCAL = "http://127.0.0.1"  # the Host allow-list admits loopback names


@pytest.fixture(scope="module")
def parts():
    executor = FakeEmbedExecutor()
    engine = EmbeddingEngine(executor)
    state = embedding_only_state(ServerConfig(), {"mini": engine}, None)
    yield state, executor
    engine.shutdown()


@pytest.fixture(scope="module")
def client(parts):
    with TestClient(build_app(parts[0]), base_url=LOCAL) as c:
        yield c


def ids_of(text: str) -> list[int]:
    return FakeEmbedExecutor().tokenize(text)


def post(client, body, path="/v1/embeddings"):
    return client.post(path, json=body)


def test_strings_come_back_in_order_normalised_with_usage(client):
    texts = ["the cat sat", "a dog", "fish swim in the sea"]
    r = post(client, {"model": "mini", "input": texts})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == "mini"
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    for item, text in zip(body["data"], texts):
        np.testing.assert_allclose(item["embedding"], vector(ids_of(text)), rtol=1e-6)
    tokens = sum(len(ids_of(t)) for t in texts)
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}


def test_one_string_token_ids_and_lists_of_ids_agree(client):
    ids = ids_of("hello there world")
    one = post(client, {"model": "mini", "input": "hello there world"}).json()["data"]
    flat = post(client, {"model": "mini", "input": ids}).json()["data"]
    lists = post(client, {"model": "mini", "input": [ids, ids[:2]]}).json()["data"]
    assert len(one) == len(flat) == 1 and len(lists) == 2
    np.testing.assert_allclose(one[0]["embedding"], flat[0]["embedding"])
    np.testing.assert_allclose(lists[0]["embedding"], one[0]["embedding"])
    np.testing.assert_allclose(lists[1]["embedding"], vector(ids[:2]), rtol=1e-6)


def test_base64_is_little_endian_float32_of_the_same_vector(client):
    body = {"model": "mini", "input": "some words here"}
    floats = post(client, body).json()["data"][0]["embedding"]
    packed = post(client, {**body, "encoding_format": "base64"}).json()["data"][0]["embedding"]
    decoded = np.frombuffer(base64.b64decode(packed), dtype="<f4")
    np.testing.assert_allclose(decoded, floats, rtol=1e-6)


def test_dimensions_truncates_and_renormalises(client):
    full = np.array(vector(ids_of("alpha beta gamma")))
    r = post(client, {"model": "mini", "input": "alpha beta gamma", "dimensions": 3})
    got = np.array(r.json()["data"][0]["embedding"])
    assert got.shape == (3,)
    np.testing.assert_allclose(got, full[:3] / np.linalg.norm(full[:3]), rtol=1e-5)


def test_model_defaults_to_the_embedding_model(client):
    assert post(client, {"input": "x y"}).json()["model"] == "mini"


@pytest.mark.parametrize(
    "body, status, param, code",
    [
        ({"input": []}, 400, "input", "invalid_value"),
        ({"input": ["a"] * 100_000}, 400, "input", "invalid_value"),
        ({"input": [CLS, 5, 100, SEP]}, 400, "input[2]", "invalid_value"),
        ({"input": [[CLS, 5], [CLS, -1]]}, 400, "input[1][1]", "invalid_value"),
        ({"input": [[CLS, 5], [1.5]]}, 400, "input[1][0]", "invalid_type"),
        ({"input": [[]]}, 400, "input[0]", "invalid_value"),
        ({"input": ["ok", ""]}, 400, "input[1]", "invalid_value"),
        ({"input": 5}, 400, "input", "invalid_type"),
        ({"input": ["a", 5]}, 400, "input", "invalid_type"),
        ({"input": [True, 3]}, 400, "input", "invalid_type"),
        ({"input": {"text": "a"}}, 400, "input", "invalid_type"),
        ({}, 400, "input", "missing_required_field"),
        ({"input": "a", "encoding_format": "hex"}, 400, "encoding_format", "invalid_value"),
        ({"input": "a", "dimensions": "3"}, 400, "dimensions", "invalid_type"),
        ({"input": "a", "dimensions": 0}, 400, "dimensions", "invalid_value"),
        ({"input": "a", "dimensions": 9}, 400, "dimensions", "invalid_value"),
        ({"input": "a", "model": 7}, 400, "model", "invalid_type"),
        ({"input": "a", "model": "nope"}, 404, "model", "model_not_found"),
        ({"input": "a", "service_tier": "gold"}, 400, "service_tier", "invalid_value"),
        ({"input": "a", "user": 3}, 400, "user", "invalid_type"),
        ({"input": "a", "temperature": 1}, 400, "temperature", "unknown_parameter"),
        ({"input": " ".join(["w"] * 20)}, 400, "input[0]", "context_length_exceeded"),
    ],
)
def test_bad_openai_input_is_a_400_at_the_exact_field(client, body, status, param, code):
    r = post(client, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert (error["param"], error["code"]) == (param, code)
    assert error["type"] in ("invalid_request_error", "not_found_error")


def test_not_json_is_an_openai_400(client):
    r = client.post(
        "/v1/embeddings", content=b"{nope", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and "error" in r.json()


def test_ollama_embed_shape(client):
    r = post(client, {"model": "mini", "input": ["one two", "three"]}, "/api/embed")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "mini" and len(body["embeddings"]) == 2
    np.testing.assert_allclose(body["embeddings"][1], vector(ids_of("three")), rtol=1e-6)
    assert body["prompt_eval_count"] == len(ids_of("one two")) + len(ids_of("three"))
    assert body["total_duration"] > 0 and body["load_duration"] == 0
    single = post(client, {"model": "mini", "input": "three", "keep_alive": "5m"}, "/api/embed")
    assert single.json()["embeddings"] == [body["embeddings"][1]]


def test_ollama_truncate_keeps_sep_and_false_refuses(client):
    long_text = " ".join(f"w{i}" for i in range(30))
    r = post(client, {"model": "mini", "input": long_text}, "/api/embed")
    assert r.status_code == 200
    cut = ids_of(long_text)[:15] + [SEP]
    np.testing.assert_allclose(r.json()["embeddings"][0], vector(cut), rtol=1e-6)
    refused = post(client, {"model": "mini", "input": long_text, "truncate": False}, "/api/embed")
    assert refused.status_code == 400 and "input[0]" in refused.json()["error"]


@pytest.mark.parametrize(
    "body, status, field",
    [
        ({"input": "a"}, 400, "model"),
        ({"model": "mini", "input": []}, 400, "input"),
        ({"model": "mini", "input": ["a"] * 100_000}, 400, "input"),
        ({"model": "mini", "input": [1, 2]}, 400, "input"),
        ({"model": "mini", "input": "a", "truncate": "yes"}, 400, "truncate"),
        ({"model": "mini", "input": "a", "dimensions": 1.5}, 400, "dimensions"),
        ({"model": "mini", "input": "a", "keep_alive": "soon"}, 400, "keep_alive"),
        ({"model": "mini", "input": "a", "options": []}, 400, "options"),
        ({"model": "nope", "input": "a"}, 404, "model"),
    ],
)
def test_bad_ollama_input_is_ollama_shaped_naming_the_field(client, body, status, field):
    r = post(client, body, "/api/embed")
    assert r.status_code == status, r.text
    assert set(r.json()) == {"error"} and field in r.json()["error"]


def test_an_embedding_model_refuses_chat_with_a_400(client):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "model_not_generative"


def with_default(state, **changes):
    """The state with its default model's runtime changed (e.g. a chat model's name)."""
    return replace(state, models=ModelSet([replace(state.models.default, **changes)]))


def test_a_chat_model_asked_for_embeddings_is_a_clear_400(parts):
    state, _ = parts
    with_chat = with_default(state, name="chat")  # "chat": the server's chat model
    with TestClient(build_app(with_chat), base_url=LOCAL) as c:
        r = c.post("/v1/embeddings", json={"model": "chat", "input": "hi"})
        assert r.status_code == 400
        assert r.json()["error"]["code"] == "model_not_embedding"
        assert r.json()["error"]["param"] == "model"
        assert "chat" in r.json()["error"]["message"]
        none = replace(with_chat, embedders={})
    with TestClient(build_app(none), base_url=LOCAL) as c:
        r = c.post("/v1/embeddings", json={"model": "chat", "input": "hi"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_embedding"


def test_tier_entitlement_applies_to_embeddings(parts):
    from ultrafast.server.tenants import hash_key, parse_api_keys

    keys = {"gold": "sk-gold-0123456789", "plain": "sk-plain-0123456789"}
    spec = {
        "tenants": [
            {
                "name": "gold",
                "keys": [{"sha256": hash_key(keys["gold"])}],
                "tiers": ["priority", "default", "flex"],
            },
            {"name": "plain", "keys": [{"sha256": hash_key(keys["plain"])}]},
        ]
    }
    keyed = replace(parts[0], api_keys=parse_api_keys(spec))
    with TestClient(build_app(keyed), base_url=LOCAL) as c:

        def call(who, tier, path="/v1/embeddings"):
            body = {"model": "mini", "input": "a b", "service_tier": tier}
            if path == "/api/embed":
                body.pop("service_tier")
            return c.post(path, json=body, headers={"Authorization": f"Bearer {keys[who]}"})

        assert call("gold", "priority").status_code == 200
        refused = call("plain", "priority")
        assert refused.status_code == 403
        assert refused.json()["error"]["type"] == "permission_error"
        assert refused.json()["error"]["param"] == "service_tier"
        assert call("plain", "auto").status_code == 200  # auto falls back to default
        assert call("plain", None, "/api/embed").status_code == 200
        assert c.post("/v1/embeddings", json={"input": "a"}).status_code == 401


def test_models_lists_the_embedding_model_with_its_shape(client):
    data = client.get("/v1/models").json()["data"]
    assert [m["id"] for m in data] == ["mini"]
    assert data[0]["embedding"] == {"dimensions": 8, "pooling": "mean"}
    assert client.get("/v1/models/mini").json()["embedding"]["dimensions"] == 8


def test_a_dead_embedding_engine_is_a_503_not_a_hang():
    engine = EmbeddingEngine(FakeEmbedExecutor())
    state = embedding_only_state(ServerConfig(), {"mini": engine}, None)
    chat_beside = with_default(state, name="chat", engine=type("Alive", (), {"alive": True})())
    engine.shutdown()
    with TestClient(build_app(chat_beside), base_url=LOCAL) as c:
        r = c.post("/v1/embeddings", json={"model": "mini", "input": "a"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"


def test_a_keys_default_tier_serves_embeddings_that_name_none(parts, monkeypatch):
    from ultrafast.request import ServiceTier
    from ultrafast.server.frontends import embeddings
    from ultrafast.server.tenants import hash_key, parse_api_keys

    tiers = []
    real_embed = embeddings.embed

    async def recording(engine, ids, tier):
        tiers.append(tier)
        return await real_embed(engine, ids, tier)

    monkeypatch.setattr(embeddings, "embed", recording)
    key = "sk-lite-0123456789"
    spec = {
        "tenants": [
            {
                "name": "lite",
                "tiers": ["default", "flex"],
                "keys": [{"sha256": hash_key(key), "default_tier": "flex"}],
            }
        ]
    }
    keyed = replace(parts[0], api_keys=parse_api_keys(spec))
    auth = {"Authorization": f"Bearer {key}"}
    with TestClient(build_app(keyed), base_url=LOCAL) as c:
        assert c.post("/v1/embeddings", json={"input": "a b"}, headers=auth).status_code == 200
        body = {"input": "a b", "service_tier": "default"}
        assert c.post("/v1/embeddings", json=body, headers=auth).status_code == 200
        body = {"model": "mini", "input": "a b"}
        assert c.post("/api/embed", json=body, headers=auth).status_code == 200
    assert tiers == [ServiceTier.FLEX, ServiceTier.DEFAULT, ServiceTier.FLEX]
