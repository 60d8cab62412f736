"""`ultrafast serve model.gguf` with nothing beside the file: completions and chat from the
GGUF's own metadata; a GGUF that cannot be served stops the server with a clear error.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import httpx
import pytest

from ultrafast.config import DEMO_MODEL_DIR
from ultrafast_harness.bench.server_process import ServerProcess


def convert(src, out):
    done = subprocess.run(
        [sys.executable, "-m", "ultrafast.cli", "convert", str(src), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return out


@pytest.fixture(scope="module")
def lone_server(tmp_path_factory):
    path = convert(DEMO_MODEL_DIR, tmp_path_factory.mktemp("alone") / "demo-lone.gguf")
    srv = ServerProcess("--priority-ttft-ms", "10000", "--spec", "off", model=path)
    yield srv
    srv.stop()


def test_completions_and_chat_from_a_lone_gguf(lone_server):
    models = httpx.get(lone_server.url + "/v1/models", timeout=30).json()
    assert [m["id"] for m in models["data"]] == ["demo-lone"]
    done = httpx.post(
        lone_server.url + "/v1/completions",
        timeout=120,
        json={
            "model": "demo-lone",
            "prompt": "def fibonacci(n):",
            "max_tokens": 12,
            "temperature": 0,
        },
    )
    assert done.status_code == 200, done.text
    assert done.json()["choices"][0]["text"]
    chat = httpx.post(
        lone_server.url + "/v1/chat/completions",
        timeout=120,
        json={
            "model": "demo-lone",
            "messages": [{"role": "user", "content": "def add(a, b):"}],
            "max_tokens": 12,
            "temperature": 0,
        },
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["prompt_tokens"] > 5  # the GGUF's ChatML template was applied


def test_a_model_without_chat_template_answers_chat_with_400(tmp_path):
    src = tmp_path / "no-template"
    shutil.copytree(DEMO_MODEL_DIR, src, ignore=shutil.ignore_patterns("*.gguf"))
    config = json.loads((src / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (src / "tokenizer_config.json").write_text(json.dumps(config))
    path = convert(src, tmp_path / "plain.gguf")
    srv = ServerProcess("--priority-ttft-ms", "10000", "--spec", "off", model=path)
    try:
        done = httpx.post(
            srv.url + "/v1/completions",
            timeout=120,
            json={"model": "plain", "prompt": "def f(x):", "max_tokens": 4},
        )
        assert done.status_code == 200, done.text
        chat = httpx.post(
            srv.url + "/v1/chat/completions",
            timeout=120,
            json={
                "model": "plain",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4,
            },
        )
        assert chat.status_code == 400, chat.text
        assert "no chat template" in chat.json()["error"]["message"]
    finally:
        srv.stop()


def test_serve_exits_non_zero_on_a_truncated_gguf(tmp_path):
    path = convert(DEMO_MODEL_DIR, tmp_path / "whole.gguf")
    (tmp_path / "cut.gguf").write_bytes(path.read_bytes()[:4096])
    done = subprocess.run(
        [sys.executable, "-m", "ultrafast.cli", "serve", str(tmp_path / "cut.gguf"), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "cut.gguf is truncated" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.real_model
def test_serve_smollm2_gguf_alone_answers_the_chat(tmp_path):
    from tests.model.gguf_files import require_smollm2

    alone = tmp_path / "smollm2-135m-instruct.gguf"
    alone.symlink_to(require_smollm2())
    srv = ServerProcess(
        "--priority-ttft-ms", "10000", "--spec", "off", model=alone, max_model_len=1024
    )
    try:
        chat = httpx.post(
            srv.url + "/v1/chat/completions",
            timeout=120,
            json={
                "model": "smollm2-135m-instruct",
                "temperature": 0,
                "max_tokens": 48,
                "messages": [
                    {"role": "system", "content": "Answer in one short sentence."},
                    {"role": "user", "content": "What is the capital of France?"},
                ],
            },
        )
        assert chat.status_code == 200, chat.text
        choice = chat.json()["choices"][0]
        assert "Paris" in choice["message"]["content"] and choice["finish_reason"] == "stop"
        assert "<|im_end|>" not in choice["message"]["content"]
    finally:
        srv.stop()
