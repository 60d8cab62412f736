"""Bad inputs of RELIABILITY.md 7a against the protocol layer: exact status, type, code, param."""

import pytest

from ultrafast.request import ServiceTier
from ultrafast.server.errors import APIError
from ultrafast.server.json_body import check_content_type, parse_json_body
from ultrafast.server.protocol import Limits, parse_chat_request, parse_completion_request

LIMITS = Limits(vocab_size=1000, max_tokens_cap=512)
MSG = [{"role": "user", "content": "hi"}]


def chat(**fields):
    return {"messages": MSG, **fields}


def refusal(fn, *args):
    with pytest.raises(APIError) as info:
        fn(*args)
    e = info.value
    assert set(e.to_dict()["error"]) >= {"message", "type", "param", "code"}
    return e.status, e.type, e.code, e.param


JSON_CASES = {
    "B1 truncated": (b'{"model":', (400, "invalid_request_error", "invalid_json", None)),
    "B2 list": (b"[]", (400, "invalid_request_error", "invalid_json", None)),
    "B2 string": (b'"x"', (400, "invalid_request_error", "invalid_json", None)),
    "B2 number": (b"3", (400, "invalid_request_error", "invalid_json", None)),
    "B16 NaN": (b'{"temperature": NaN}', (400, "invalid_request_error", "invalid_json", None)),
    "B16 Infinity": (b'{"temperature": Infinity}',
                     (400, "invalid_request_error", "invalid_json", None)),
    "B27 0xFF": (b'{"a": "\xff"}', (400, "invalid_request_error", "invalid_utf8", None)),
    "B27 lone surrogate": (rb'{"a": "\ud800"}', (400, "invalid_request_error", "invalid_utf8",
                                                 None)),
    "B29 deep": (b"[" * 100_000, (400, "invalid_request_error", "invalid_json", None)),
    "B30 duplicate": (b'{"model":"a","model":"b"}',
                      (400, "invalid_request_error", "invalid_json", None)),
}


@pytest.mark.parametrize("case", sorted(JSON_CASES))
def test_json_body_refusals(case):
    raw, expected = JSON_CASES[case]
    assert refusal(parse_json_body, raw) == expected


def test_valid_json_with_surrogate_pair_and_nul_is_accepted():
    body = parse_json_body(rb'{"a": "\ud83d\ude00 \u0000 ok", "b": "\\ud800"}')
    assert body["a"] == "\U0001F600 \x00 ok" and body["b"] == "\\ud800"


def test_b3_content_type():
    assert refusal(check_content_type, "text/plain")[2] == "unsupported_media_type"
    assert refusal(check_content_type, None)[0] == 415
    check_content_type("application/json; charset=utf-8")


def test_b4_body_size():
    assert refusal(parse_json_body, b" " * 100, 50)[:3] == (413, "invalid_request_error",
                                                           "payload_too_large")


IV = "invalid_value"
CHAT_CASES = {
    "B7 no messages": ({}, (400, "missing_required_field", "messages")),
    "B8 empty": ({"messages": []}, (400, IV, "messages")),
    "B9 role": ({"messages": [{"role": "root", "content": "x"}]}, (400, IV, "messages[0].role")),
    "B9 content number": ({"messages": [{"role": "user", "content": 5}]},
                          (400, IV, "messages[0].content")),
    "B9 content object": ({"messages": [{"role": "user", "content": {"a": 1}}]},
                          (400, IV, "messages[0].content")),
    "B10 too many": ({"messages": MSG * 2049}, (400, "too_many_messages", "messages")),
    "B12 zero": (chat(max_tokens=0), (400, IV, "max_tokens")),
    "B12 negative": (chat(max_tokens=-1), (400, IV, "max_tokens")),
    "B13 huge": (chat(max_tokens=2 ** 63), (400, IV, "max_tokens")),
    "B13 over cap": (chat(max_tokens=513), (400, IV, "max_tokens")),
    "B13 completion tokens": (chat(max_completion_tokens=10 ** 6),
                              (400, IV, "max_completion_tokens")),
    "B14 string": (chat(max_tokens="100"), (400, "invalid_type", "max_tokens")),
    "B14 float": (chat(max_tokens=1.5), (400, "invalid_type", "max_tokens")),
    "B14 bool": (chat(max_tokens=True), (400, "invalid_type", "max_tokens")),
    "B15 n huge": (chat(n=1_000_000), (400, IV, "n")),
    "B15 n zero": (chat(n=0), (400, IV, "n")),
    "B16 temperature": (chat(temperature=-1), (400, IV, "temperature")),
    "B17 top_p 0": (chat(top_p=0), (400, IV, "top_p")),
    "B17 top_p 1.5": (chat(top_p=1.5), (400, IV, "top_p")),
    "B17 top_k": (chat(top_k=-5), (400, IV, "top_k")),
    "B18 frequency": (chat(frequency_penalty=3), (400, IV, "frequency_penalty")),
    "B19 top_logprobs": (chat(logprobs=True, top_logprobs=1000), (400, IV, "top_logprobs")),
    "B19 n_probs": (chat(n_probs=10 ** 9), (400, "unknown_parameter", "n_probs")),
    "B20 prompt_logprobs": (chat(prompt_logprobs=-1), (400, "unknown_parameter",
                                                       "prompt_logprobs")),
    "B21 five stops": (chat(stop=["a", "b", "c", "d", "e"]), (400, IV, "stop")),
    "B21 long stop": (chat(stop="x" * 10_000), (400, IV, "stop")),
    "B22 empty stop": (chat(stop=""), (400, IV, "stop")),
    "B22 empty stop list": (chat(stop=[""]), (400, IV, "stop")),
    "B23 key": (chat(logit_bias={"abc": 1}), (400, IV, "logit_bias")),
    "B23 id": (chat(logit_bias={"1000": 1}), (400, IV, "logit_bias")),
    "B23 count": (chat(logit_bias={str(i): 1 for i in range(301)}), (400, IV, "logit_bias")),
    "B23 value": (chat(logit_bias={"1": 1e9}), (400, IV, "logit_bias")),
    "B26 huge message": ({"messages": [{"role": "user", "content": "x" * 1_000_001}]},
                         (413, "prompt_too_large", "messages")),
    "B31 bad schema": (chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "foo"}}}), (400, IV, "response_format")),
    "B31 no schema": (chat(response_format={"type": "json_schema"}),
                      (400, IV, "response_format")),
    "B34 big schema": (chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"description": "x" * 70_000}}}),
        (413, "grammar_too_large", "response_format")),
    "B35 pattern": (chat(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "string", "pattern": 5}}}]),
        (400, IV, "tools[0].function.parameters")),
    "B35 type": (chat(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "foo"}}}]),
        (400, IV, "tools[0].function.parameters")),
    "B36 many tools": (chat(tools=[{"type": "function", "function": {"name": "f"}}] * 129),
                       (400, IV, "tools")),
    "B36 name": (chat(tools=[{"type": "function", "function": {"name": "../x"}}]),
                 (400, IV, "tools[0].function.name")),
    "B37 logits_processors": (chat(logits_processors=["x"]),
                              (400, "unknown_parameter", "logits_processors")),
    "B37 prompt_embeds": (chat(prompt_embeds="AAAA"), (400, "unknown_parameter",
                                                       "prompt_embeds")),
    "B38 chat_template": (chat(chat_template="{{ x }}"), (400, "unknown_parameter",
                                                          "chat_template")),
    "B38 kwargs": (chat(chat_template_kwargs={"tokenize": True}),
                   (400, "unknown_parameter", "chat_template_kwargs")),
    "B39 image url": ({"messages": [{"role": "user", "content": [{
        "type": "image_url", "image_url": {"url": "http://169.254.169.254/"}}]}]},
        (400, "unsupported_content", "messages[0].content[0]")),
    "B39 file": ({"messages": [{"role": "user", "content": [{
        "type": "file", "file": {"file_data": "file:///etc/passwd"}}]}]},
        (400, "unsupported_content", "messages[0].content[0]")),
    "B40 stream_options": (chat(stream_options={"include_usage": True}),
                           (400, IV, "stream_options")),
    "B42 priority name": (chat(priority="warp9"), (400, IV, "priority")),
    "B42 priority number": (chat(priority=1e9), (400, IV, "priority")),
    "B42 service_tier": (chat(service_tier="warp9"), (400, IV, "service_tier")),
    "B43 traversal": (chat(session_id="../../etc"), (400, IV, "session_id")),
    "B43 long": (chat(session_id="a" * 10_000), (400, IV, "session_id")),
    "B43 non-ascii": (chat(session_id="sé"), (400, IV, "session_id")),
    "B43 star": (chat(session_id="*"), (400, IV, "session_id")),
}


@pytest.mark.parametrize("case", sorted(CHAT_CASES))
def test_chat_refusals(case):
    body, (status, code, param) = CHAT_CASES[case]
    got = refusal(parse_chat_request, body, LIMITS)
    assert (got[0], got[2], got[3]) == (status, code, param)
    assert got[1] == "invalid_request_error"


COMPLETION_CASES = {
    "B7 no prompt": ({}, (400, "missing_required_field", "prompt")),
    "B24 negative": ({"prompt": [-1]}, (400, IV, "prompt")),
    "B24 vocab": ({"prompt": [1000]}, (400, IV, "prompt")),
    "B24 2**31": ({"prompt": [2 ** 31]}, (400, IV, "prompt")),
    "B24 nested": ({"prompt": [[1, 2], [5000]]}, (400, IV, "prompt")),
    "logprobs over cap": ({"prompt": "x", "logprobs": 21}, (400, IV, "logprobs")),
}


@pytest.mark.parametrize("case", sorted(COMPLETION_CASES))
def test_completion_refusals(case):
    body, (status, code, param) = COMPLETION_CASES[case]
    got = refusal(parse_completion_request, body, LIMITS)
    assert (got[0], got[2], got[3]) == (status, code, param)


def test_full_chat_request_maps_to_sampling_params():
    req = parse_chat_request(chat(
        model="m", max_completion_tokens=33, temperature=0.5, top_p=0.9, top_k=40, min_p=0.05,
        n=2, stop=["\n\n"], seed=7, presence_penalty=0.5, frequency_penalty=-0.5,
        logit_bias={"5": -100}, logprobs=True, top_logprobs=3, user="u", stream=True,
        stream_options={"include_usage": True}, service_tier="ultrafast"), LIMITS)
    p = req.sampling_params(LIMITS.vocab_size, req.requested_max_tokens())
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == \
        (33, 0.5, 0.9, 40, 0.05, 7)
    assert (p.presence_penalty, p.frequency_penalty, p.logit_bias) == (0.5, -0.5, ((5, -100.0),))
    assert p.logprobs and p.top_logprobs == 3
    assert req.tier() == ServiceTier.PRIORITY and req.include_usage() and req.n == 2
    assert req.stop_list() == ["\n\n"]


def test_completion_prompt_forms():
    assert parse_completion_request({"prompt": "a"}, LIMITS).prompt_list() == ["a"]
    assert parse_completion_request({"prompt": ["a", "b"]}, LIMITS).prompt_list() == ["a", "b"]
    assert parse_completion_request({"prompt": [1, 2]}, LIMITS).prompt_list() == [[1, 2]]
    assert parse_completion_request({"prompt": [[1], [2]]}, LIMITS).prompt_list() == [[1], [2]]
    req = parse_completion_request({"prompt": "a", "logprobs": 2, "echo": True}, LIMITS)
    p = req.sampling_params(1000, 5)
    assert p.logprobs and p.top_logprobs == 2 and p.temperature == 1.0 and req.echo


def test_content_parts_join_into_text():
    req = parse_chat_request({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}, LIMITS)
    assert req.messages_for_template() == [{"role": "user", "content": "ab"}]
