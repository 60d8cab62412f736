"""A model without a chat template, served: chat is refused with a 400 naming --chat-template;
with `--chat-template chatml` it chats. The same server's sampling flags fill what requests
leave out (`--temperature 0`: any seed gives the greedy text) while a request's own fields win,
and `--max-tokens` caps an answer whose request sets no limit. The model is the demo model
with its template taken out of tokenizer_config.json (it chats in ChatML)."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest

from ultrafast.config import DEMO_MODEL_DIR
from ultrafast_harness.bench.server_process import ServerProcess

QUESTION = [{"role": "user", "content": "def fibonacci(n):"}]
FAST_START = ("--threads", "1", "--batch-threads", "1", "--priority-ttft-ms", "10000")


@pytest.fixture(scope="module")
def templateless_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("bare") / "demo-bare"
    shutil.copytree(DEMO_MODEL_DIR, path)
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template")
    config_path.write_text(json.dumps(config))
    return path


def chat(server, **body):
    body = {"model": "demo-bare", "messages": QUESTION, **body}
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)


def test_without_a_template_chat_is_a_400_naming_the_flag(templateless_model):
    srv = ServerProcess(*FAST_START, model=templateless_model, num_slots=1)
    try:
        refused = chat(srv, max_tokens=4)
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["code"] == "no_chat_template" and "--chat-template" in error["message"]
        raw = httpx.post(
            srv.url + "/v1/completions",
            json={"model": "demo-bare", "prompt": "def f(x):", "max_tokens": 3},
            timeout=120,
        )
        assert raw.status_code == 200, raw.text  # completions need no template
    finally:
        srv.stop()


def test_chat_template_flag_and_sampling_flags(templateless_model):
    srv = ServerProcess(
        *FAST_START,
        "--chat-template",
        "chatml",
        "--temperature",
        "0",
        "--max-tokens",
        "6",
        model=templateless_model,
        num_slots=2,
    )
    try:
        texts = []
        for seed in (1, 2, 3):
            done = chat(srv, seed=seed)
            assert done.status_code == 200, done.text
            body = done.json()
            # no max_tokens in the request: --max-tokens caps it
            assert body["usage"]["completion_tokens"] <= 6
            texts.append(body["choices"][0]["message"]["content"])
        assert len(set(texts)) == 1  # --temperature 0 filled in: greedy whatever the seed
        greedy = chat(srv, max_tokens=6, temperature=0).json()["choices"][0]["message"]
        assert greedy["content"] == texts[0]
        sampled = {
            chat(srv, seed=seed, temperature=2.0, top_p=1.0, max_tokens=12).json()["choices"][0][
                "message"
            ]["content"]
            for seed in range(4)
        }
        assert len(sampled) > 1  # the request's own temperature wins over the flag
    finally:
        srv.stop()


def gemma3_or_skip():
    from ultrafast.model_fetch_gemma import SHA256, gemma3_gguf

    path = gemma3_gguf()
    if not path.is_file():
        pytest.skip(f"{path.name} not fetched (python -m ultrafast.model_fetch_gemma)")
    return path, SHA256


def test_gemma3_base_gguf_chats_with_the_gemma_template():
    path, _ = gemma3_or_skip()
    question = [{"role": "user", "content": "What is the capital of France?"}]
    body = {"messages": question, "max_tokens": 24, "temperature": 0}
    bare = ServerProcess(*FAST_START, model=path, num_slots=1, max_model_len=512)
    try:
        body["model"] = httpx.get(bare.url + "/v1/models", timeout=30).json()["data"][0]["id"]
        refused = httpx.post(bare.url + "/v1/chat/completions", json=body, timeout=120)
    finally:
        bare.stop()
    assert refused.status_code == 400 and "--chat-template" in refused.text
    srv = ServerProcess(
        *FAST_START, "--chat-template", "gemma", model=path, num_slots=1, max_model_len=512
    )
    try:
        done = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=300)
    finally:
        srv.stop()
    assert done.status_code == 200, done.text
    choice = done.json()["choices"][0]
    assert choice["message"]["content"].strip()
    assert "<start_of_turn>" not in choice["message"]["content"]  # the turn ended, not ran on
