"""Speculative decoding through the server: predicted outputs with the official client.

The server runs with its defaults (spec auto, drafting on for the priority tier). Greedy text
must not depend on speculation: priority (drafting) == default (plain) == with a prediction;
streaming delivers the same text; usage reports the prediction tokens accepted / rejected.
"""

from __future__ import annotations

import openai
import pytest

MESSAGES = [{"role": "user", "content": "def read_config(path):"}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def chat(client, **kw):
    args = dict(model="demo-code", messages=MESSAGES, max_tokens=48, temperature=0)
    return client.chat.completions.create(**{**args, **kw})


def test_priority_drafting_gives_the_plain_text(client):
    plain = chat(client, service_tier="default")
    fast = chat(client, service_tier="priority")
    assert fast.service_tier == "priority"
    assert fast.choices[0].message.content == plain.choices[0].message.content
    assert fast.usage.completion_tokens == plain.usage.completion_tokens
    details = plain.usage.completion_tokens_details
    assert details.accepted_prediction_tokens is None  # no prediction sent: not reported


def test_prediction_is_used_and_counted(client):
    plain = chat(client, service_tier="flex")
    text = plain.choices[0].message.content
    edited = text.replace("test", "t3st", 1)  # a prediction that is mostly right
    assert edited != text, "the plain answer must contain the word the test edits"
    for tier in ("flex", "priority"):
        out = chat(client, service_tier=tier, prediction={"type": "content", "content": edited})
        assert out.choices[0].message.content == text
        details = out.usage.completion_tokens_details
        assert details.accepted_prediction_tokens > 10
        assert details.rejected_prediction_tokens > 0  # the edited word's tokens
        assert details.accepted_prediction_tokens <= out.usage.completion_tokens


def test_prediction_with_streaming_logprobs_and_stop(client):
    plain = chat(client, logprobs=True, service_tier="default")
    text = plain.choices[0].message.content
    prediction = {"type": "content", "content": text}
    chunks = list(
        chat(
            client,
            prediction=prediction,
            stream=True,
            logprobs=True,
            stream_options={"include_usage": True},
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    tokens = [
        t
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content
    ]
    assert len(tokens) == plain.usage.completion_tokens  # every token once, in order
    assert [t.token for t in tokens] == [t.token for t in plain.choices[0].logprobs.content]
    # same values up to the f16 kernels' batch-size rounding (k+1 positions vs one)
    assert all(
        abs(a.logprob - b.logprob) < 0.02 for a, b in zip(tokens, plain.choices[0].logprobs.content)
    )
    usage = chunks[-1].usage
    assert usage.completion_tokens_details.accepted_prediction_tokens > 10
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = chat(client, prediction=prediction, stop=[stop])
    assert cut.choices[0].message.content == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    short = chat(client, prediction=prediction, max_tokens=5)
    assert short.usage.completion_tokens == 5 and text.startswith(short.choices[0].message.content)
