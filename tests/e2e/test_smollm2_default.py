"""SmolLM2-135M-Instruct as the default model: `ultrafast serve` with no model serves it as
`smollm2-135m-instruct`, answers the Paris question, and speculation (n-gram, predicted
outputs) and the priority tier work on it. The bundled demo draft model has another tokenizer:
the server says so at start and drafts without it.

One server for the module, started the way a user starts it (no model argument). Drafting is
on for the default tier, its draft lengths from the fixed default costs (`--spec-costs
fixed`): with the measured ones, drafting stops where it does not pay, and on the 2-core AVX2
EPYC a lone 2-token pass of this model costs 1.9x a 1-token one (15.2 vs 7.9 ms), so the
drafts this test checks came only in some runs. Flex requests decode plainly and give the
reference text.
"""

from __future__ import annotations

import re

import httpx
import pytest

from ultrafast_harness.bench.server_process import ServerProcess

pytestmark = pytest.mark.real_model

NAME = "smollm2-135m-instruct"
PARIS = [
    {"role": "system", "content": "Answer in one short sentence."},
    {"role": "user", "content": "What is the capital of France?"},
]
ECHO = [
    {"role": "system", "content": "Repeat the user's text exactly."},
    {"role": "user", "content": "The quick brown fox jumps over the lazy dog near the river bank."},
]


@pytest.fixture(scope="module")
def smollm2_server():
    from tests.model.gguf_files import require_smollm2

    gguf = require_smollm2()
    with pytest.MonkeyPatch.context() as env:
        env.delenv("ULTRAFAST_MODEL", raising=False)  # the tests' demo default (conftest)
        env.setenv("ULTRAFAST_SMOLLM2_GGUF", str(gguf))
        # model "": no model argument, as `make run` starts it
        srv = ServerProcess(
            "--spec-tiers",
            "default,priority",
            "--spec-costs",
            "fixed",
            model="",
            num_slots=2,
            max_model_len=1024,
        )
    yield srv
    srv.stop()


def chat(server, messages, tier="default", max_tokens=32, **extra):
    body = {
        "model": NAME,
        "messages": messages,
        "temperature": 0,
        "max_tokens": max_tokens,
        "service_tier": tier,
        **extra,
    }
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)


def spec_counters(server) -> dict[tuple[str, str], float]:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    found = re.findall(
        r'^ultrafast_spec_(draft|accepted)_tokens_total\{source="(\w+)"\} (\S+)$', text, re.M
    )
    return {(kind, source): float(n) for kind, source, n in found}


def test_default_model_is_smollm2_and_answers_paris(smollm2_server):
    models = httpx.get(smollm2_server.url + "/v1/models", timeout=30).json()
    assert [m["id"] for m in models["data"]] == [NAME]
    done = chat(smollm2_server, PARIS, tier="flex")
    assert done.status_code == 200, done.text
    choice = done.json()["choices"][0]
    assert choice["message"]["content"] == "The capital of France is Paris."
    assert choice["finish_reason"] == "stop"


def test_ngram_drafts_give_the_plain_text(smollm2_server):
    before = spec_counters(smollm2_server)
    plain = chat(smollm2_server, ECHO, tier="flex").json()
    drafted = chat(smollm2_server, ECHO, tier="default").json()
    after = spec_counters(smollm2_server)
    text = plain["choices"][0]["message"]["content"]
    assert drafted["choices"][0]["message"]["content"] == text and "fox" in text
    assert drafted["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"]
    gained = after.get(("accepted", "ngram"), 0) - before.get(("accepted", "ngram"), 0)
    assert gained > 0  # drafts from the prompt were proposed and accepted
    assert after.get(("draft", "draft"), 0) == 0  # the demo draft model never drafted


def test_predicted_output_gives_the_plain_text(smollm2_server):
    plain = chat(smollm2_server, PARIS, tier="flex").json()
    text = plain["choices"][0]["message"]["content"]
    edited = text.replace("France", "Spain")  # a prediction that is mostly right
    out = chat(
        smollm2_server, PARIS, tier="flex", prediction={"type": "content", "content": edited}
    )
    assert out.status_code == 200, out.text
    body = out.json()
    assert body["choices"][0]["message"]["content"] == text
    assert body["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] > 0


def test_priority_request_on_an_idle_server(smollm2_server):
    plain = chat(smollm2_server, PARIS, tier="flex").json()
    done = chat(smollm2_server, PARIS, tier="priority")
    # a 429 here on an idle server is issue 17 part 9 (tier targets that fit the model)
    assert done.status_code == 200, done.text
    body = done.json()
    assert body["service_tier"] == "priority"
    assert body["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]


def generate(*args: str):
    import subprocess
    import sys

    from tests.model.gguf_files import require_smollm2

    cmd = [sys.executable, "-m", "ultrafast.cli", "generate", "Hi", "--max-tokens", "2"]
    return subprocess.run(
        [*cmd, "--model", str(require_smollm2()), "--threads", "1", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_demo_draft_model_is_not_used_on_another_tokenizer():
    from ultrafast.config import DEMO_DRAFT_DIR

    auto = generate("--spec", "auto", "--draft-model", str(DEMO_DRAFT_DIR))
    assert auto.returncode == 0, auto.stderr
    warning = [line for line in auto.stderr.splitlines() if "WARNING" in line or "draft" in line]
    assert any("demo-draft" in w and "SmolLM2-135M-Instruct" in w for w in warning), auto.stderr
    for args in (("--spec", "draft"), ("--spec", "draft", "--draft-model", str(DEMO_DRAFT_DIR))):
        refused = generate(*args)
        assert refused.returncode == 2, refused.stderr
        assert "does not use the tokenizer of SmolLM2-135M-Instruct" in refused.stderr
        assert "Traceback" not in refused.stderr
