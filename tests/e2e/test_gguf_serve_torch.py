"""`ultrafast serve model.gguf --executor torch`: the torch executor serves a GGUF file alone,
its tensors dequantized, and answers as the ggml executor does on the same f32 file; a GGUF
of an architecture our torch model lacks stops the server with a pointer to --executor ggml.
"""

from __future__ import annotations

import subprocess
import sys

import httpx

from tests.model.gguf_files import write_vocab_gguf
from ultrafast.config import DEMO_MODEL_DIR
from ultrafast_harness.bench.server_process import ServerProcess

PROMPT = "def fibonacci(n):"


def test_torch_executor_serves_a_lone_gguf_like_ggml(tmp_path):
    path = tmp_path / "demo-f32.gguf"
    done = subprocess.run(
        [sys.executable, "-m", "ultrafast.cli", "convert", str(DEMO_MODEL_DIR), str(path)]
        + ["--outtype", "f32"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    texts = {}
    for kind in ("torch", "ggml"):
        srv = ServerProcess("--executor", kind, "--spec", "off", model=path, num_slots=2)
        try:
            body = {"model": "demo-f32", "prompt": PROMPT, "max_tokens": 16, "temperature": 0}
            reply = httpx.post(srv.url + "/v1/completions", json=body, timeout=120)
            assert reply.status_code == 200, reply.text
            texts[kind] = reply.json()["choices"][0]["text"]
            chat = httpx.post(
                srv.url + "/v1/chat/completions",
                timeout=120,
                json={
                    "model": "demo-f32",
                    "messages": [{"role": "user", "content": "def add(a, b):"}],
                    "max_tokens": 4,
                },
            )
            assert chat.status_code == 200, chat.text
        finally:
            srv.stop()
    assert texts["torch"] and texts["torch"] == texts["ggml"]


def test_serve_refuses_a_foreign_architecture_on_torch(tmp_path):
    path = write_vocab_gguf(tmp_path / "phi2.gguf", arch="phi2")
    done = subprocess.run(
        [sys.executable, "-m", "ultrafast.cli", "serve", str(path), "--port", "0"]
        + ["--executor", "torch"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "'phi2'" in done.stderr and "--executor ggml" in done.stderr
    assert "Traceback" not in done.stderr
