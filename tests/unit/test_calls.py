"""The typed call input each front end builds (server/calls.py), and admission reading the
engine's published step costs instead of its live model."""

from __future__ import annotations

import pytest

from ultrafast.config import ServerConfig
from ultrafast.request import ServiceTier
from ultrafast.server.admission import Admission
from ultrafast.server.bridge import StepCostSnapshot
from ultrafast.server.calls import chat_call, check_options, completion_call
from ultrafast.server.errors import APIError
from ultrafast.server.protocol import Limits, parse_chat_request, parse_completion_request

LIMITS = Limits(vocab_size=100, features=frozenset({"session_id"}))


def test_chat_call_carries_typed_messages_params_and_the_names_errors_use():
    req = parse_chat_request(
        {
            "messages": [
                {"role": "system", "content": "s"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
            ],
            "max_completion_tokens": 7,
            "top_k": 5,
            "logit_bias": {"3": 1.5},
            "n": 2,
            "service_tier": "auto",
            "stop": "x",
        },
        LIMITS,
    )
    call = chat_call(req, LIMITS)
    assert [(m.role, m.content, m.token_ids) for m in call.messages] == [
        ("system", "s", None),
        ("user", "a\nb", None),
    ]
    assert call.params.top_k == 5 and call.params.logit_bias == ((3, 1.5),)
    assert (call.max_tokens, call.max_tokens_param) == (7, "max_completion_tokens")
    assert call.auto_tier and call.tier_param == "service_tier" and call.n == 2
    assert call.stops == ["x"] and call.chat and call.prompt_param == "messages"


def test_completion_call_keeps_prompts_and_names_the_prompt():
    req = parse_completion_request(
        {"prompt": ["a", [1, 2]], "echo": True, "max_tokens": 3, "priority": "priority"}, LIMITS
    )
    call = completion_call(req, LIMITS)
    assert call.prompts == ["a", [1, 2]] and call.echo and not call.chat
    assert call.tier == ServiceTier.PRIORITY and call.tier_param == "priority"
    assert call.prompt_param == "prompt" and call.max_tokens == 3


@pytest.mark.parametrize(
    "fields, param",
    [
        (dict(max_tokens=0), "max_output_tokens"),
        (dict(temperature=2.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(service_tier="gold"), "service_tier"),
        (dict(service_tier=3), "service_tier"),
    ],
)
def test_check_options_refuses_with_the_callers_own_field_names(fields, param):
    options = dict(temperature=None, top_p=None, max_tokens=None, service_tier=None)
    options.update(fields)
    with pytest.raises(APIError) as refused:
        check_options(LIMITS, max_tokens_param="max_output_tokens", **options)
    assert (refused.value.code, refused.value.param) == ("invalid_value", param)


def test_check_options_gives_the_tier_and_auto():
    def tier(value):
        return check_options(
            LIMITS,
            temperature=None,
            top_p=None,
            max_tokens=None,
            max_tokens_param="max_output_tokens",
            service_tier=value,
        )

    assert tier(None) == (ServiceTier.DEFAULT, False)
    assert tier("priority") == (ServiceTier.PRIORITY, False)
    assert tier("auto")[1] is True


def test_admission_predicts_from_the_latest_published_step_costs():
    published = [StepCostSnapshot()]  # nothing measured: the fixed fallback
    admission = Admission(ServerConfig(), step_costs=lambda: published[-1])
    assert admission.predict_ttft_s(ServiceTier.PRIORITY, 10) == pytest.approx(0.01 + 0.02)
    published.append(StepCostSnapshot(base_s=0.001, per_token_s=0.001))  # the engine measured
    ticket = admission.reserve(ServiceTier.PRIORITY)
    admission.admit(ticket, 200, auto=False)  # 0.201 s: within the 250 ms target
    admission.release(ticket)
    published.append(StepCostSnapshot(base_s=0.001, per_token_s=0.01))  # the engine slowed
    ahead = admission.admit(admission.reserve(ServiceTier.PRIORITY), 200, auto=False)
    ticket = admission.reserve(ServiceTier.PRIORITY)
    with pytest.raises(APIError) as refused:
        admission.admit(ticket, 10, auto=False)  # 200 queued tokens add 2 s now
    assert (refused.value.status, refused.value.code) == (429, "priority_slo_unattainable")
    assert admission.in_flight[ServiceTier.PRIORITY] == 1
    admission.release(ahead)


def test_the_models_sampling_defaults_fill_only_what_the_client_left_out():
    limits = Limits(
        vocab_size=100,
        sampling_defaults=(
            ("min_p", 0.05),
            ("repetition_penalty", 1.1),
            ("temperature", 0.2),
            ("top_k", 20),
            ("top_p", 0.9),
        ),
    )
    plain = chat_call(
        parse_chat_request({"messages": [{"role": "user", "content": "hi"}]}, limits), limits
    ).params
    assert (plain.temperature, plain.top_p, plain.top_k, plain.min_p, plain.repetition_penalty) == (
        0.2,
        0.9,
        20,
        0.05,
        1.1,
    )
    own = completion_call(
        parse_completion_request(
            {
                "prompt": "hi",
                "temperature": 1.0,
                "top_p": 1.0,
                "top_k": 3,
                "min_p": 0.0,
                "repetition_penalty": 1.0,
            },
            limits,
        ),
        limits,
    ).params
    assert (own.temperature, own.top_p, own.top_k, own.min_p, own.repetition_penalty) == (
        1.0,
        1.0,
        3,
        0.0,
        1.0,
    )
    without = chat_call(
        parse_chat_request({"messages": [{"role": "user", "content": "hi"}]}, LIMITS), LIMITS
    ).params
    assert (without.temperature, without.top_p, without.top_k) == (1.0, 1.0, 0)
