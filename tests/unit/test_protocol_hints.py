"""OpenAI fields the request models accept rather than refuse: hints, integral floats, top_p 0,
OpenAI's whole service_tier enum, completions echo scoring. Bad values of them still get one
clear 400 each (the refusal table of the other fields is test_protocol.py)."""

import pytest

from ultrafast.request import SamplingParams, ServiceTier
from ultrafast.server.errors import APIError
from ultrafast.server.protocol import Limits, parse_chat_request, parse_completion_request

LIMITS = Limits(vocab_size=1000, max_tokens_cap=512)
MSG = [{"role": "user", "content": "hi"}]


def chat(**fields):
    return parse_chat_request({"messages": MSG, **fields}, LIMITS)


def completion(**fields):
    return parse_completion_request({"prompt": "x", **fields}, LIMITS)


def refused(fn, **fields) -> tuple[int, str, str]:
    with pytest.raises(APIError) as info:
        fn(**fields)
    return info.value.status, info.value.code, info.value.param


HINTS = dict(
    safety_identifier="hash-of-user",
    prompt_cache_key="tenant-a/app-1",
    prompt_cache_retention="24h",
    reasoning_effort="minimal",
    verbosity="low",
)


def test_hints_are_accepted_and_change_no_sampling_setting():
    req = chat(
        **HINTS, stream=True, stream_options={"include_usage": True, "include_obfuscation": False}
    )
    assert req.sampling_params(1000, 9) == chat().sampling_params(1000, 9)
    assert req.prompt_cache_key == "tenant-a/app-1" and req.include_usage()
    assert completion(**HINTS).prompt_cache_key == "tenant-a/app-1"
    for retention in ("in_memory", "in-memory"):
        chat(prompt_cache_retention=retention)
    for effort in ("none", "xhigh", "max"):
        chat(reasoning_effort=effort)


@pytest.mark.parametrize(
    "field,value,code",
    [
        ("reasoning_effort", "extreme", "invalid_value"),
        ("verbosity", "loud", "invalid_value"),
        ("prompt_cache_retention", "1y", "invalid_value"),
        ("verbosity", 3, "invalid_type"),
        ("safety_identifier", "u" * 129, "invalid_value"),
        ("safety_identifier", "", "invalid_value"),
        ("prompt_cache_key", "k" * 1025, "invalid_value"),
        ("prompt_cache_key", ["k"], "invalid_type"),
    ],
)
def test_bad_hint_values_are_refused_by_name(field, value, code):
    assert refused(chat, **{field: value}) == (400, code, field)


def test_bad_include_obfuscation_is_refused():
    assert refused(chat, stream=True, stream_options={"include_obfuscation": "no"}) == (
        400,
        "invalid_type",
        "stream_options.include_obfuscation",
    )


def test_integral_floats_count_as_integers():
    req = chat(
        n=2.0,
        max_tokens=16.0,
        seed=3.0,
        top_k=5.0,
        logprobs=True,
        top_logprobs=2.0,
        max_completion_tokens=8.0,
    )
    assert (req.n, req.seed, req.top_k, req.top_logprobs) == (2, 3, 5, 2)
    assert type(req.n) is int and req.sampling_params(1000, 1).max_tokens == 8
    req = completion(logprobs=1.0, best_of=1.0, max_tokens=4.0)
    assert req.sampling_params(1000, 1) == SamplingParams(
        max_tokens=4, logprobs=True, top_logprobs=1
    )
    for field in ("n", "max_tokens", "seed", "top_k"):
        assert refused(chat, **{field: 2.5}) == (400, "invalid_type", field)
    assert refused(completion, logprobs=1.5) == (400, "invalid_type", "logprobs")
    assert refused(chat, n=True) == (400, "invalid_type", "n")
    assert refused(chat, seed=1e30) == (400, "invalid_value", "seed")  # integral, out of range


def test_top_p_0_is_greedy():
    params = chat(top_p=0, temperature=0.8, seed=1).sampling_params(1000, 5)
    assert params.greedy and params.top_p == 1.0
    assert chat(top_p=0.0).sampling_params(1000, 5).greedy


@pytest.mark.parametrize(
    "name,tier,auto",
    [
        ("scale", ServiceTier.PRIORITY, True),
        ("fast", ServiceTier.PRIORITY, False),
        ("auto", ServiceTier.DEFAULT, True),
        ("priority", ServiceTier.PRIORITY, False),
        ("default", ServiceTier.DEFAULT, False),
        ("flex", ServiceTier.FLEX, False),
    ],
)
def test_openai_service_tier_enum(name, tier, auto):
    for field in ("service_tier", "priority"):
        req = chat(**{field: name})
        assert req.tier() == tier and req.tier_is_auto() == auto


def test_echo_scores_the_prompt_and_max_tokens_0_needs_echo():
    assert completion(echo=True, logprobs=3).sampling_params(1000, 5).prompt_logprobs == 3
    assert completion(logprobs=3).sampling_params(1000, 5).prompt_logprobs is None
    assert completion(echo=True).sampling_params(1000, 5).prompt_logprobs is None
    score_only = completion(echo=True, max_tokens=0).sampling_params(1000, 5)
    assert score_only.max_tokens == 0 and score_only.prompt_logprobs == 0
    assert not score_only.logprobs  # no logprobs asked for: the response shows none
    status, code, param = refused(completion, max_tokens=0)
    assert (status, code, param) == (400, "invalid_value", "max_tokens")
    assert refused(chat, max_tokens=0) == (400, "invalid_value", "max_tokens")
