"""`ultrafast serve` with all-MiniLM-L6-v2: alone, and beside a chat model with --models.
The official openai client's embeddings (it asks for base64), Ollama's /api/embed, a chat
model asked for embeddings (400) and the embedding model asked to chat (400)."""

from __future__ import annotations

import concurrent.futures

import httpx
import numpy as np
import pytest

from tests.embed_model import minilm
from ultrafast.config import DEMO_MODEL_DIR
from ultrafast.executors.ggml_embed import EmbeddingExecutor
from ultrafast_harness.bench.server_process import ServerProcess

openai = pytest.importorskip("openai")

# the server serves on the path it measures fastest at start (executors/embed_choice.py), bf16
# only where its vectors keep this cosine with llama.cpp's f32 ones (what `expected` holds)
SAME = 0.9995
TEXTS = ["A man is eating food.", "A monkey plays the drums.", "Stocks fell sharply today."]


@pytest.fixture(scope="module")
def expected():
    ex = EmbeddingExecutor(str(minilm()[1]), n_threads=1)
    try:
        return ex.embed([ex.tokenize(t) for t in TEXTS])
    finally:
        ex.close()


@pytest.fixture(scope="module")
def alone():
    srv = ServerProcess("--served-model-name", "minilm", "--threads", "1", model=minilm()[1])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def beside():
    gguf = minilm()[1]
    srv = ServerProcess(
        "--models", f"code={DEMO_MODEL_DIR},minilm={gguf}", "--threads", "1", model=None
    )
    yield srv
    srv.stop()


def test_openai_client_embeds_alone(alone, expected):
    client = openai.OpenAI(base_url=alone.url + "/v1", api_key="unused")
    got = client.embeddings.create(model="minilm", input=TEXTS)  # base64 on the wire
    vectors = np.array([d.embedding for d in got.data])
    assert vectors.shape == (3, 384)
    assert (vectors * expected).sum(axis=1).min() > SAME
    assert got.usage.prompt_tokens == got.usage.total_tokens > len(TEXTS) * 3
    floats = client.embeddings.create(model="minilm", input=TEXTS[0], encoding_format="float")
    assert np.dot(floats.data[0].embedding, expected[0]) > SAME
    short = client.embeddings.create(model="minilm", input=TEXTS[0], dimensions=64)
    assert len(short.data[0].embedding) == 64


def test_ollama_client_embeds_by_its_name_tag(alone, expected):
    ollama = pytest.importorskip("ollama", reason="the official ollama client (test extra)")
    got = ollama.Client(host=alone.url).embed(model="minilm:latest", input=TEXTS)
    vectors = np.array(got.embeddings)
    assert vectors.shape == (3, 384) and (vectors * expected).sum(axis=1).min() > SAME
    assert got.prompt_eval_count > len(TEXTS) * 3


def test_concurrent_requests_each_get_their_own_vectors(alone, expected):
    def one(i: int) -> np.ndarray:
        body = {"model": "minilm", "input": TEXTS[i % 3]}
        r = httpx.post(alone.url + "/v1/embeddings", json=body, timeout=60)
        return np.array(r.json()["data"][0]["embedding"])

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(24)))
    for i, vector in enumerate(results):
        assert np.dot(vector, expected[i % 3]) > SAME


def test_embedding_model_alone_refuses_chat(alone):
    body = {"model": "minilm", "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(alone.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_generative"
    assert httpx.get(alone.url + "/ready", timeout=10).status_code == 200


def test_beside_a_chat_model_both_serve(beside, expected):
    url = beside.url
    chat = httpx.post(
        url + "/v1/completions",
        json={"model": "code", "prompt": "def f(x):", "max_tokens": 4, "temperature": 0},
        timeout=60,
    )
    assert chat.status_code == 200, chat.text
    emb = httpx.post(url + "/v1/embeddings", json={"model": "minilm", "input": TEXTS}, timeout=60)
    assert emb.status_code == 200, emb.text
    vectors = np.array([d["embedding"] for d in emb.json()["data"]])
    assert (vectors * expected).sum(axis=1).min() > SAME
    models = {m["id"]: m for m in httpx.get(url + "/v1/models", timeout=10).json()["data"]}
    assert set(models) == {"code", "minilm"}
    assert models["minilm"]["embedding"] == {"dimensions": 384, "pooling": "mean"}
    ollama = httpx.post(url + "/api/embed", json={"model": "minilm", "input": TEXTS[1]}, timeout=60)
    assert ollama.status_code == 200
    assert np.dot(ollama.json()["embeddings"][0], expected[1]) > SAME


def test_chat_model_asked_for_embeddings_is_a_400(beside):
    r = httpx.post(beside.url + "/v1/embeddings", json={"model": "code", "input": "x"}, timeout=30)
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "model_not_embedding"
    assert r.json()["error"]["param"] == "model"
    r = httpx.post(beside.url + "/api/embed", json={"model": "code", "input": "x"}, timeout=30)
    assert r.status_code == 400 and "no embedding mode" in r.json()["error"]


def test_ollama_client_lists_shows_and_ps_the_embedding_model(beside):
    ollama = pytest.importorskip("ollama", reason="the official ollama client (test extra)")
    client = ollama.Client(host=beside.url)
    listed = {m.model: m for m in client.list().models}
    assert set(listed) == {"code:latest", "minilm:latest"}
    assert listed["minilm:latest"].details.family == "bert"
    assert listed["minilm:latest"].size == minilm()[1].stat().st_size
    shown = client.show("minilm")
    assert shown.capabilities == ["embedding"]
    assert shown.details.family == "bert" and shown.details.format == "gguf"
    assert shown.modelinfo["bert.pooling_type"] == 1  # mean, as the GGUF declares
    assert shown.modelinfo["bert.embedding_length"] == 384
    assert "embedding" not in client.show("code").capabilities
    running = {m.model: m for m in client.ps().models}
    assert set(running) == {"code:latest", "minilm:latest"}
    assert running["minilm:latest"].context_length == 512
    assert running["minilm:latest"].details.family == "bert"


def test_ollama_chat_with_the_embedding_model_is_refused_in_ollamas_shape(beside):
    r = httpx.post(
        beside.url + "/api/chat",
        json={"model": "minilm", "messages": [{"role": "user", "content": "hi"}]},
        timeout=30,
    )
    assert r.status_code == 400 and "embedding model" in r.json()["error"]
