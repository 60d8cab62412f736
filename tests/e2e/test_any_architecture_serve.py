"""`ultrafast serve` on GGUFs of architectures our torch model does not implement (random-weight
gpt2 and starcoder2, written at test time by tests/model/arch_ggufs.py with the demo model's
vocabulary and ChatML template): completions and chat answer 200 and stream the same text,
n-gram speculation in the priority tier drafts, is accepted and keeps the greedy text; a GGUF
llama.cpp cannot load stops the server with llama.cpp's reason.
"""

from __future__ import annotations

import re
import subprocess
import sys

import httpx
import openai
import pytest

from tests.model.arch_ggufs import ARCHS, write_arch_gguf
from ultrafast_harness.bench.server_process import ServerProcess

PROMPT = "def fibonacci(n):"  # gpt2's random weights loop from here: n-gram drafts get accepted
MESSAGES = [{"role": "user", "content": "def add(a, b):"}]


@pytest.fixture(scope="module", params=ARCHS)
def served(request, tmp_path_factory):
    arch = request.param
    path = write_arch_gguf(tmp_path_factory.mktemp(arch) / f"tiny-{arch}.gguf", arch)
    srv = ServerProcess(
        "--priority-ttft-ms",
        "10000",
        "--spec",
        "ngram",
        "--spec-costs",
        "fixed",  # the drafts must not depend on this machine's load
        "--threads",
        "1",
        model=path,
    )
    yield arch, srv, openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    srv.stop()


def spec_counter(srv, name: str) -> float:
    text = httpx.get(srv.url + "/metrics", timeout=30).text
    match = re.search(rf'^{name}_total\{{source="ngram"\}} (\S+)$', text, re.M)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


def test_models_lists_the_file(served):
    arch, srv, _ = served
    models = httpx.get(srv.url + "/v1/models", timeout=30).json()
    assert [m["id"] for m in models["data"]] == [f"tiny-{arch}"]


def test_completions_answer_and_stream_the_same_text(served):
    arch, _, client = served
    args = dict(model=f"tiny-{arch}", prompt=PROMPT, max_tokens=24, temperature=0)
    done = client.completions.create(**args)
    text = done.choices[0].text
    assert text and done.usage.completion_tokens > 0
    chunks = list(client.completions.create(stream=True, **args))
    assert len(chunks) > 2
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text


def test_chat_answers_and_streams_with_the_gguf_template(served):
    arch, _, client = served
    args = dict(model=f"tiny-{arch}", messages=MESSAGES, max_tokens=24, temperature=0)
    done = client.chat.completions.create(**args)
    assert done.choices[0].message.role == "assistant"
    assert done.usage.prompt_tokens > 8  # the ChatML template wrapped the message
    text = done.choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, **args))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text


def test_ngram_speculation_keeps_the_greedy_text(served):
    arch, srv, client = served
    args = dict(model=f"tiny-{arch}", prompt=PROMPT, max_tokens=40, temperature=0)
    drafted, accepted = (
        spec_counter(srv, "ultrafast_spec_draft_tokens"),
        spec_counter(srv, "ultrafast_spec_accepted_tokens"),
    )
    # --spec-tiers defaults to priority: the default tier runs without drafts
    plain = client.completions.create(extra_body={"service_tier": "default"}, **args)
    fast = client.completions.create(extra_body={"service_tier": "priority"}, **args)
    assert fast.choices[0].text == plain.choices[0].text
    assert spec_counter(srv, "ultrafast_spec_draft_tokens") > drafted
    if arch == "gpt2":  # the looping model: drafts are right
        assert spec_counter(srv, "ultrafast_spec_accepted_tokens") > accepted


def test_serve_exits_non_zero_when_llama_cpp_cannot_load_the_file(tmp_path):
    path = write_arch_gguf(tmp_path / "unknown.gguf", "gpt2", declare_as="gpt7")
    done = subprocess.run(
        [sys.executable, "-m", "ultrafast.cli", "serve", str(path), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "unknown model architecture: 'gpt7'" in done.stderr
    assert "Traceback" not in done.stderr
