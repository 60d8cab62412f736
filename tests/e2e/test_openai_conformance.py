"""OpenAI conformance of /v1/completions, /v1/chat/completions and /v1/models, on the demo
model through the official `openai` client and raw HTTP.

Prompt scoring (`echo` + `logprobs`, the pattern evaluation harnesses use) is checked against
transformers' own logits over the same ids, on the ggml server (the `server` fixture) and on
a torch-executor server.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

from ultrafast.config import DEMO_MODEL_DIR
from ultrafast_harness.bench.server_process import ServerProcess

PROMPT = (
    "import os\nimport sys\n\n\ndef main(argv):\n    for arg in argv[1:]:\n        print(arg)\n"
)
# ggml serves the f16 GGUF with an f16 KV cache: its logprobs differ from float32 transformers
# by about 1e-3 here; the torch executor runs float32 like the reference
TOLERANCE = {"ggml": 2e-2, "torch": 1e-4}


@pytest.fixture(scope="module")
def torch_server():
    srv = ServerProcess("--executor", "torch", "--priority-ttft-ms", "10000")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def servers(server, torch_server):
    return {"ggml": server, "torch": torch_server}


@pytest.fixture(scope="module")
def reference():
    """transformers' float32 model: logprobs of every next token over a list of ids."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:  # [len(ids) - 1, vocab]: row i scores ids[i+1]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, :-1].float()
        return torch.log_softmax(logits, dim=-1)

    return logprobs


def client_of(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


def token_ids(srv, text: str) -> list[int]:
    return httpx.post(srv.url + "/tokenize", json={"prompt": text}).json()["tokens"]


def post(srv, path: str, body: dict) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, timeout=60)


def check_offsets(text: str, logprobs) -> None:
    """Each token's text sits at its offset in the choice's text, in order, with no gaps."""
    offsets, tokens = logprobs.text_offset, logprobs.tokens
    assert offsets[0] == 0 and "".join(tokens) == text
    for token, offset, after in zip(tokens, offsets, offsets[1:] + [len(text)]):
        assert text[offset : offset + len(token)] == token and after == offset + len(token)


# ---- /v1/models/{model} -------------------------------------------------------------------


def test_models_retrieve_and_unknown_model(server):
    client = client_of(server)
    model = client.models.retrieve("demo-code")
    assert model.id == "demo-code" and model.object == "model" and model.owned_by
    assert model.model_dump() == client.models.list().data[0].model_dump()
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("org/not-here")
    error = info.value.body
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "org/not-here" in error["message"]
    r = httpx.get(server.url + "/v1/models/" + "x" * 5000)
    assert r.status_code == 404 and len(r.text) < 1000  # the echoed name is cut short
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


# ---- echo + logprobs: the prompt scored ---------------------------------------------------


@pytest.mark.parametrize("executor", ["ggml", "torch"])
def test_echo_logprobs_equal_the_models_own(servers, reference, executor):
    srv = servers[executor]
    ids = token_ids(srv, PROMPT)
    expected = reference(ids)
    # first a plain call, so the prompt's KV is in the prefix cache: scoring must not use it
    client_of(srv).completions.create(model="demo-code", prompt=PROMPT, max_tokens=2)
    out = client_of(srv).completions.create(
        model="demo-code", prompt=PROMPT, echo=True, logprobs=1, max_tokens=4, temperature=0
    )
    choice = out.choices[0]
    lp = choice.logprobs
    n = len(ids)
    assert choice.text.startswith(PROMPT) and len(lp.tokens) == n + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    got = torch.tensor(lp.token_logprobs[1:n])
    want = expected.gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    torch.testing.assert_close(got, want, atol=TOLERANCE[executor], rtol=0)
    best = expected.max(dim=-1).values
    for i in range(1, n):  # one alternative: the model's most likely token at that position
        (value,) = lp.top_logprobs[i].values()
        assert abs(value - best[i - 1].item()) <= TOLERANCE[executor]
    check_offsets(choice.text, lp)
    assert lp.text_offset[n] == len(PROMPT)  # the first generated token follows the echo


def test_score_only_with_max_tokens_0(server, reference):
    ids = token_ids(server, PROMPT)
    out = client_of(server).completions.create(
        model="demo-code", prompt=ids, echo=True, logprobs=0, max_tokens=0
    )
    choice = out.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == len(ids)
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None
    want = reference(ids).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    torch.testing.assert_close(
        torch.tensor(lp.token_logprobs[1:]), want, atol=TOLERANCE["ggml"], rtol=0
    )
    # logprobs 0: each entry's top_logprobs holds the token itself
    assert all(
        top == {tok: v}
        for tok, v, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:])
    )
    check_offsets(choice.text, lp)
    streamed = list(
        client_of(server).completions.create(
            model="demo-code", prompt=ids, echo=True, logprobs=0, max_tokens=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in streamed) == PROMPT
    again = streamed[0].choices[0].logprobs.token_logprobs
    assert again[0] is None and len(again) == len(ids)
    torch.testing.assert_close(
        torch.tensor(again[1:]), torch.tensor(lp.token_logprobs[1:]), atol=1e-5, rtol=0
    )
    assert streamed[-1].choices[0].finish_reason == "length"
    r = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert "echo" in r.json()["error"]["message"]


def test_echo_logprobs_for_a_batch_and_n(server):
    prompts = ["def f(x):\n", "class A:\n    pass\n"]
    out = post(
        server,
        "/v1/completions",
        {"prompt": prompts, "n": 2, "echo": True, "logprobs": 2, "max_tokens": 3, "temperature": 0},
    ).json()
    assert len(out["choices"]) == 4
    for choice in out["choices"]:
        prompt = prompts[choice["index"] // 2]
        lp = choice["logprobs"]
        n = len(token_ids(server, prompt))
        assert choice["text"].startswith(prompt) and len(lp["tokens"]) == n + 3
        assert "".join(lp["tokens"][:n]) == prompt and lp["text_offset"][n] == len(prompt)
        assert all(len(top) == 2 for top in lp["top_logprobs"][1:])


# ---- streamed text_offset -----------------------------------------------------------------


def test_streamed_text_offsets_accumulate(server):
    body = dict(
        model="demo-code", prompt="def fibonacci(n):", max_tokens=12, temperature=0, logprobs=1
    )
    full = client_of(server).completions.create(**body).choices[0]
    chunks = [c.choices[0] for c in client_of(server).completions.create(**body, stream=True)]
    offsets = [o for c in chunks if c.logprobs for o in c.logprobs.text_offset]
    assert offsets == full.logprobs.text_offset and offsets[0] == 0
    assert offsets == sorted(offsets) and offsets[-1] > 0
    check_offsets(full.text, full.logprobs)
    echoed = [
        c.choices[0] for c in client_of(server).completions.create(**body, stream=True, echo=True)
    ]
    assert echoed[0].text == "def fibonacci(n):" and echoed[0].logprobs.token_logprobs[0] is None
    generated = [o for c in echoed[1:] if c.logprobs for o in c.logprobs.text_offset]
    assert generated == [o + len("def fibonacci(n):") for o in offsets]


def test_logprobs_0_gives_the_sampled_tokens_entry(server):
    out = client_of(server).completions.create(
        model="demo-code", prompt="x = ", max_tokens=4, logprobs=0, temperature=0
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 4
    assert all(v is not None and v <= 0 for v in lp.token_logprobs)
    assert lp.top_logprobs == [{t: v} for t, v in zip(lp.tokens, lp.token_logprobs)]


# ---- hint fields, integral floats, best_of, top_p 0, service_tier ----------------------


def test_openai_hint_fields_are_accepted(server):
    client = client_of(server)
    messages = [{"role": "user", "content": "def add(a, b):"}]
    hints = dict(
        safety_identifier="user-hash-1",
        prompt_cache_key="tenant-a/chat",
        prompt_cache_retention="24h",
        reasoning_effort="low",
        verbosity="low",
    )
    out = client.chat.completions.create(
        model="demo-code", messages=messages, max_tokens=3, temperature=0, **hints
    )
    plain = client.chat.completions.create(
        model="demo-code", messages=messages, max_tokens=3, temperature=0
    )
    assert out.choices[0].message.content == plain.choices[0].message.content
    chunks = list(
        client.chat.completions.create(
            model="demo-code",
            messages=messages,
            max_tokens=3,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True, "include_obfuscation": False},
        )
    )
    assert chunks[-1].usage.completion_tokens == 3
    r = post(server, "/v1/chat/completions", {"messages": messages, "verbosity": "loud"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "verbosity"


def test_integral_floats_best_of_1_and_top_p_0(server):
    body = {"prompt": "def f(x):", "temperature": 0.7, "max_tokens": 5}
    exact = post(server, "/v1/completions", {**body, "n": 2, "seed": 3, "logprobs": 1}).json()
    floats = post(
        server,
        "/v1/completions",
        {**body, "n": 2.0, "seed": 3.0, "logprobs": 1.0, "max_tokens": 5.0, "best_of": 1},
    ).json()
    assert [c["text"] for c in floats["choices"]] == [c["text"] for c in exact["choices"]]
    assert floats["usage"]["completion_tokens"] == 10
    for field, value in (("n", 2.5), ("max_tokens", 16.5), ("seed", 0.5)):
        r = post(server, "/v1/completions", {**body, field: value})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_type"
        assert r.json()["error"]["param"] == field
    r = post(server, "/v1/completions", {**body, "best_of": 3})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unknown_parameter"
    assert "only accepted as 1" in r.json()["error"]["message"]
    greedy = post(server, "/v1/completions", {**body, "temperature": 0}).json()
    nucleus_0 = post(server, "/v1/completions", {**body, "top_p": 0, "seed": 5}).json()
    assert nucleus_0["choices"][0]["text"] == greedy["choices"][0]["text"]


@pytest.mark.parametrize("tier,served", [("scale", "priority"), ("fast", "priority")])
def test_openai_tier_names_map_to_a_served_tier(server, tier, served):
    out = client_of(server).chat.completions.create(
        model="demo-code",
        messages=[{"role": "user", "content": "x"}],
        max_tokens=2,
        service_tier=tier,
    )
    assert out.service_tier == served
    r = post(
        server,
        "/v1/completions",
        {"prompt": "x", "max_tokens": 2, "service_tier": tier, "stream": True},
    )
    assert r.headers["x-service-tier"] == served
    first = json.loads(r.text.split("\n\n")[0].removeprefix("data: "))
    assert first["service_tier"] == served
