"""Schema-driven fuzz of every generation route, OpenAI's and the other protocols' (issue 33,
"Bad input"): from a valid body per route, deterministic mutations (a field dropped, a value
of each other JSON type, an unknown field, a nested value broken, a body that is not an
object) are sent to the real server. None may answer 5xx, and every refusal must be in the
route's own error shape. Seeded, so a failure names a reproducible body."""

from __future__ import annotations

import copy
import random

import httpx
import pytest

from ultrafast_harness.bench.server_process import ServerProcess

MODEL = "demo-code"
USER = {"role": "user", "content": "def f():"}
SEEDS = {
    "/v1/chat/completions": {"model": MODEL, "messages": [USER], "max_tokens": 2, "temperature": 0},
    "/v1/completions": {"model": MODEL, "prompt": "def f():", "max_tokens": 2},
    "/v1/responses": {"model": MODEL, "input": [USER], "max_output_tokens": 2, "store": False},
    "/v1/messages": {
        "model": MODEL,
        "max_tokens": 2,
        "system": [{"type": "text", "text": "Be short."}],
        "messages": [
            USER,
            {"role": "assistant", "content": [{"type": "text", "text": "ok"}]},
            USER,
        ],
        "stop_sequences": ["\n\n"],
        "tools": [{"name": "t", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "auto"},
        "metadata": {"user_id": "u"},
    },
    "/v1/messages/count_tokens": {"model": MODEL, "messages": [USER]},
    "/api/chat": {
        "model": MODEL + ":latest",
        "messages": [USER],
        "stream": False,
        "options": {"temperature": 0, "num_predict": 2, "stop": ["\n"]},
    },
    "/api/generate": {
        "model": MODEL,
        "prompt": "def f():",
        "stream": False,
        "options": {"num_predict": 2, "top_k": 5},
    },
    "/api/show": {"model": MODEL},
}
ODD_VALUES = [None, 0, -1, 1.5, 1e308, "", "x", True, [], [1, "a"], {}, {"k": None}]
PER_ROUTE = 60
# the length limits stay as they are (a dropped one runs to the context's end: slow, not bad)
KEEP = {("max_tokens",), ("max_output_tokens",), ("options", "num_predict"), ("options",)}


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    db = tmp_path_factory.mktemp("fuzz") / "sessions.db"
    server = ServerProcess("--priority-ttft-ms", "10000", "--session-store", f"sqlite:///{db}")
    yield server
    server.stop()


def paths(value, at=()):
    """Every (path to a value) inside a JSON body."""
    yield at
    if isinstance(value, dict):
        for k, v in value.items():
            yield from paths(v, (*at, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from paths(v, (*at, i))


def mutate(seed: dict, rng: random.Random):
    """One or two mutations of `seed` (a copy)."""
    body = _mutate_once(copy.deepcopy(seed), rng)
    if rng.random() < 0.5:
        body = _mutate_once(body, rng)
    return body


def _mutate_once(body: dict, rng: random.Random) -> dict:
    places = [p for p in paths(body) if p and p not in KEEP]
    if not places:
        return body
    where = rng.choice(places)
    parent = body
    for part in where[:-1]:
        parent = parent[part]
    action = rng.random()
    if action < 0.2 and isinstance(parent, dict):
        del parent[where[-1]]
    elif action < 0.3 and isinstance(parent, dict):
        parent["unknown_" + str(rng.randrange(100))] = rng.choice(ODD_VALUES)
    else:
        parent[where[-1]] = copy.deepcopy(rng.choice(ODD_VALUES))
    return body


def shape_ok(path: str, r: httpx.Response) -> bool:
    body = r.json()
    if path.startswith("/v1/messages"):
        return body.get("type") == "error" and set(body["error"]) == {"type", "message"}
    if path.startswith("/api/"):
        return set(body) == {"error"} and isinstance(body["error"], str)
    return set(body["error"]) >= {"message", "type", "param", "code"}


@pytest.mark.parametrize("path", list(SEEDS))
def test_mutated_bodies_never_500_and_refuse_in_the_routes_shape(srv, path):
    rng = random.Random(path)
    seed = SEEDS[path]
    with httpx.Client(base_url=srv.url, timeout=60) as http:
        assert http.post(path, json=seed).status_code == 200  # the seed itself is valid
        bodies = [mutate(seed, rng) for _ in range(PER_ROUTE)] + [[], "x", 1, None]
        refused = 0
        for body in bodies:
            r = http.post(path, json=body)
            assert r.status_code < 500, (path, body, r.text)
            if r.status_code >= 400:
                refused += 1
                assert shape_ok(path, r), (path, body, r.text)
        assert refused >= len(bodies) // 4  # the mutations do reach the checks
        r = http.post(path, content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and shape_ok(path, r), r.text


# ---- the embedding routes, on all-MiniLM-L6-v2 (skipped, saying why, where it is absent) ----

EMBED_SEEDS = {
    "/v1/embeddings": {
        "model": "minilm",
        "input": ["a cat", "a dog"],
        "encoding_format": "float",
        "dimensions": 64,
    },
    "/api/embed": {"model": "minilm:latest", "input": ["a cat"], "truncate": True},
}


@pytest.fixture(scope="module")
def embed_srv():
    from tests.embed_model import minilm

    server = ServerProcess("--served-model-name", "minilm", "--threads", "1", model=minilm()[1])
    yield server
    server.stop()


@pytest.mark.parametrize("path", list(EMBED_SEEDS))
def test_mutated_embedding_bodies_never_500_and_refuse_in_the_routes_shape(embed_srv, path):
    rng = random.Random(path)
    seed = EMBED_SEEDS[path]
    with httpx.Client(base_url=embed_srv.url, timeout=60) as http:
        assert http.post(path, json=seed).status_code == 200, path
        bodies = [mutate(seed, rng) for _ in range(PER_ROUTE)] + [[], "x", 1, None]
        for body in bodies:
            r = http.post(path, json=body)
            assert r.status_code < 500, (path, body, r.text)
            if r.status_code >= 400:
                assert shape_ok(path, r), (path, body, r.text)
