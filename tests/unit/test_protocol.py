"""Bad inputs of docs/RELIABILITY.md 7a against the request models: exact status, type, code, param.

JSON-level rows (B1-B4, B16 NaN token, B27, B29, B30) live in test_json_body.py; B11 (unknown
model) is answered by the app, which knows the served model. Positive cases at the end: every
supported field reaches SamplingParams.
"""

import tracemalloc

import pytest

from ultrafast.request import SamplingParams, ServiceTier
from ultrafast.server.errors import APIError
from ultrafast.server.protocol import (
    OPTIONAL_FEATURES,
    Limits,
    parse_chat_request,
    parse_completion_request,
)

LIMITS = Limits(vocab_size=1000, max_tokens_cap=512)
ALL_FEATURES = Limits(vocab_size=1000, max_tokens_cap=512, features=OPTIONAL_FEATURES)
MSG = [{"role": "user", "content": "hi"}]
IV, IT = "invalid_value", "invalid_type"


def chat(**fields):
    return {"messages": MSG, **fields}


def tool(name="f", parameters=None):
    fn = {"name": name}
    if parameters is not None:
        fn["parameters"] = parameters
    return {"type": "function", "function": fn}


def schema_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}


def refusal(fn, body, limits=LIMITS):
    with pytest.raises(APIError) as info:
        fn(body, limits)
    e = info.value
    assert set(e.to_dict()["error"]) == {"message", "type", "param", "code"}
    assert e.type == "invalid_request_error"
    assert "Traceback" not in e.message and "/ultrafast/" not in e.message
    assert len(e.message) < 400
    return e.status, e.code, e.param


CHAT_CASES = {
    "B7 no messages": ({}, (400, "missing_required_field", "messages")),
    "B7 messages null": ({"messages": None}, (400, "missing_required_field", "messages")),
    "B8 empty": ({"messages": []}, (400, IV, "messages")),
    "B9 role": ({"messages": [{"role": "root", "content": "x"}]}, (400, IV, "messages[0].role")),
    "B9 no role": (
        {"messages": [{"content": "x"}]},
        (400, "missing_required_field", "messages[0].role"),
    ),
    "B9 content number": (
        {"messages": [{"role": "user", "content": 5}]},
        (400, IV, "messages[0].content"),
    ),
    "B9 content object": (
        {"messages": [{"role": "user", "content": {"a": 1}}]},
        (400, IV, "messages[0].content"),
    ),
    "B9 content null": (
        {"messages": [{"role": "user", "content": None}]},
        (400, IV, "messages[0].content"),
    ),
    "B9 second message": (
        {"messages": MSG + [{"role": "user", "content": [5]}]},
        (400, IV, "messages[1].content[0]"),
    ),
    "B9 tool without id": (
        {"messages": MSG + [{"role": "tool", "content": "r"}]},
        (400, "missing_required_field", "messages[1].tool_call_id"),
    ),
    "B10 too many": ({"messages": MSG * 2049}, (400, "too_many_messages", "messages")),
    "B12 zero": (chat(max_tokens=0), (400, IV, "max_tokens")),
    "B12 negative": (chat(max_tokens=-1), (400, IV, "max_tokens")),
    "B13 2**63": (chat(max_tokens=2**63), (400, IV, "max_tokens")),
    "B13 over cap": (chat(max_tokens=513), (400, IV, "max_tokens")),
    "B13 completion tokens": (
        chat(max_completion_tokens=10**6),
        (400, IV, "max_completion_tokens"),
    ),
    "B14 string": (chat(max_tokens="100"), (400, IT, "max_tokens")),
    "B14 float": (chat(max_tokens=1.5), (400, IT, "max_tokens")),
    "B14 bool": (chat(max_tokens=True), (400, IT, "max_tokens")),
    "B14 bool temperature": (chat(temperature=True), (400, IT, "temperature")),
    "B15 n huge": (chat(n=1_000_000), (400, IV, "n")),
    "B15 n zero": (chat(n=0), (400, IV, "n")),
    "B16 temperature": (chat(temperature=-1), (400, IV, "temperature")),
    "B16 temperature high": (chat(temperature=2.5), (400, IV, "temperature")),
    "B17 top_p negative": (chat(top_p=-0.1), (400, IV, "top_p")),
    "B17 top_p 1.5": (chat(top_p=1.5), (400, IV, "top_p")),
    "B17 top_k": (chat(top_k=-5), (400, IV, "top_k")),
    "B18 frequency": (chat(frequency_penalty=3), (400, IV, "frequency_penalty")),
    "B18 presence": (chat(presence_penalty=-2.5), (400, IV, "presence_penalty")),
    "B19 top_logprobs": (chat(logprobs=True, top_logprobs=1000), (400, IV, "top_logprobs")),
    "B19 top_logprobs without logprobs": (chat(top_logprobs=3), (400, IV, "top_logprobs")),
    "B19 n_probs": (chat(n_probs=10**9), (400, "unknown_parameter", "n_probs")),
    "B20 prompt_logprobs": (
        chat(prompt_logprobs=-1),
        (400, "unknown_parameter", "prompt_logprobs"),
    ),
    "B21 five stops": (chat(stop=["a", "b", "c", "d", "e"]), (400, IV, "stop")),
    "B21 long stop": (chat(stop="x" * 10_000), (400, IV, "stop")),
    "B21 257 bytes": (chat(stop=["é" * 129]), (400, IV, "stop")),
    "B22 empty stop": (chat(stop=""), (400, IV, "stop")),
    "B22 empty stop list": (chat(stop=[""]), (400, IV, "stop")),
    "B22 stop not text": (chat(stop=[1]), (400, IT, "stop[0]")),
    "B23 key": (chat(logit_bias={"abc": 1}), (400, IV, "logit_bias")),
    "B23 negative key": (chat(logit_bias={"-1": 1}), (400, IV, "logit_bias")),
    "B23 non-canonical key": (chat(logit_bias={"1": 1, "01": 2}), (400, IV, "logit_bias")),
    "B23 id": (chat(logit_bias={"1000": 1}), (400, IV, "logit_bias")),
    "B23 count": (chat(logit_bias={str(i): 1 for i in range(301)}), (400, IV, "logit_bias")),
    "B23 value": (chat(logit_bias={"1": 1e9}), (400, IV, "logit_bias")),
    "B23 value type": (chat(logit_bias={"1": "x"}), (400, IT, "logit_bias")),
    "B26 huge message": (
        {"messages": [{"role": "user", "content": "x" * 1_000_001}]},
        (413, "prompt_too_large", "messages"),
    ),
    "B26 many parts": (
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "x" * 500_000}] * 3}]},
        (413, "prompt_too_large", "messages"),
    ),
    "B31 bad schema": (
        chat(response_format=schema_format({"type": "foo"})),
        (400, IV, "response_format.json_schema.schema.type"),
    ),
    "B31 schema not an object": (
        chat(response_format=schema_format(5)),
        (400, IV, "response_format"),
    ),
    "B31 no schema": (chat(response_format={"type": "json_schema"}), (400, IV, "response_format")),
    "B31 bad format type": (
        chat(response_format={"type": "xml"}),
        (400, IV, "response_format.type"),
    ),
    "B34 big schema": (
        chat(response_format=schema_format({"description": "x" * 70_000})),
        (413, "grammar_too_large", "response_format"),
    ),
    "B35 pattern": (
        chat(tools=[tool(parameters={"type": "string", "pattern": 5})]),
        (400, IV, "tools[0].function.parameters.pattern"),
    ),
    "B35 type": (
        chat(tools=[tool(parameters={"type": "foo"})]),
        (400, IV, "tools[0].function.parameters.type"),
    ),
    "B35 second tool": (
        chat(tools=[tool("a"), tool("b", {"properties": 3})]),
        (400, IV, "tools[1].function.parameters.properties"),
    ),
    "B35 big parameters": (
        chat(tools=[tool(parameters={"description": "x" * 70_000})]),
        (413, "grammar_too_large", "tools[0].function.parameters"),
    ),
    "B36 many tools": (chat(tools=[tool()] * 129), (400, IV, "tools")),
    "B36 name traversal": (chat(tools=[tool("../x")]), (400, IV, "tools[0].function.name")),
    "B36 name 1 KB": (chat(tools=[tool("a" * 1024)]), (400, IV, "tools[0].function.name")),
    "B36 duplicate name": (chat(tools=[tool("a"), tool("a")]), (400, IV, "tools[1].function.name")),
    "B36 unknown tool_choice": (
        chat(tools=[tool("a")], tool_choice={"type": "function", "function": {"name": "b"}}),
        (400, IV, "tool_choice"),
    ),
    "B37 logits_processors": (
        chat(logits_processors=["x"]),
        (400, "unknown_parameter", "logits_processors"),
    ),
    "B37 custom_logit_processor": (
        chat(custom_logit_processor="gASV"),
        (400, "unknown_parameter", "custom_logit_processor"),
    ),
    "B37 prompt_embeds": (chat(prompt_embeds="AAAA"), (400, "unknown_parameter", "prompt_embeds")),
    "B37 nested unknown": (
        {"messages": [{"role": "user", "content": "x", "evil": 1}]},
        (400, "unknown_parameter", "messages[0].evil"),
    ),
    "B38 chat_template": (
        chat(chat_template="{{ x }}"),
        (400, "unknown_parameter", "chat_template"),
    ),
    "B38 chat_template_kwargs": (
        chat(chat_template_kwargs={"tokenize": True}),
        (400, "unknown_parameter", "chat_template_kwargs"),
    ),
    "B39 image url": (
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": "http://169.254.169.254/"}}
                    ],
                }
            ]
        },
        (400, "unsupported_content", "messages[0].content[0]"),
    ),
    "B39 file": (
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "see"},
                        {"type": "file", "file": {"file_data": "file:///etc/passwd"}},
                    ],
                }
            ]
        },
        (400, "unsupported_content", "messages[0].content[1]"),
    ),
    "B39 2 GB url": (
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": "http://x/" + "a" * 100_000}}
                    ],
                }
            ]
        },
        (400, "unsupported_content", "messages[0].content[0]"),
    ),
    "B40 stream_options": (
        chat(stream_options={"include_usage": True}),
        (400, IV, "stream_options"),
    ),
    "B40 stream false": (
        chat(stream=False, stream_options={"include_usage": True}),
        (400, IV, "stream_options"),
    ),
    "B42 priority name": (chat(priority="warp9"), (400, IV, "priority")),
    "B42 priority number": (chat(priority=1e9), (400, IV, "priority")),
    "B42 service_tier name": (chat(service_tier="warp9"), (400, IV, "service_tier")),
    "B42 service_tier number": (chat(service_tier=1e9), (400, IV, "service_tier")),
    "B42 disagreeing alias": (
        chat(service_tier="flex", priority="priority"),
        (400, IV, "priority"),
    ),
    "B43 traversal": (chat(session_id="../../etc"), (400, IV, "session_id")),
    "B43 10 KB": (chat(session_id="a" * 10_000), (400, IV, "session_id")),
    "B43 non-ascii": (chat(session_id="sé"), (400, IV, "session_id")),
    "B43 star": (chat(session_id="*"), (400, IV, "session_id")),
    "B43 trailing newline": (chat(session_id="abc\n"), (400, IV, "session_id")),
    "B43 not a string": (chat(session_id=5), (400, IV, "session_id")),
    "B31 bad schema, unknown draft": (
        chat(response_format=schema_format({"$schema": "http://example.com/s", "type": "foo"})),
        (400, IV, "response_format.json_schema.schema.type"),
    ),
    "B31 $schema not a string": (
        chat(response_format=schema_format({"$schema": 5, "type": "string"})),
        (400, IV, "response_format.json_schema.schema.$schema"),
    ),
    "B31 bad keyword value, deep": (
        chat(response_format=schema_format({"properties": {"a": {"minLength": -1}}})),
        (400, IV, "response_format.json_schema.schema.properties.a.minLength"),
    ),
}


@pytest.mark.parametrize("case", sorted(CHAT_CASES))
def test_chat_refusals(case):
    body, expected = CHAT_CASES[case]
    assert refusal(parse_chat_request, body, ALL_FEATURES) == expected


COMPLETION_CASES = {
    "B7 no prompt": ({}, (400, "missing_required_field", "prompt")),
    "B7 prompt null": ({"prompt": None}, (400, "missing_required_field", "prompt")),
    "B8 empty prompt list": ({"prompt": []}, (400, IV, "prompt")),
    "B8 empty token list": ({"prompt": [[1], []]}, (400, IV, "prompt")),
    "B14 prompt number": ({"prompt": 5}, (400, IT, "prompt")),
    "B14 prompt bools": ({"prompt": [True, False]}, (400, IT, "prompt")),
    "B14 prompt mixed": ({"prompt": ["a", 1]}, (400, IT, "prompt")),
    "B14 prompt nested bools": ({"prompt": ["a", [True]]}, (400, IT, "prompt")),
    "B14 logprobs bool": ({"prompt": "x", "logprobs": True}, (400, IT, "logprobs")),
    "B15 n zero": ({"prompt": "x", "n": 0}, (400, IV, "n")),
    "B15 prompts x n": ({"prompt": ["x"] * 5, "n": 8}, (400, IV, "prompt")),
    "B19 logprobs over cap": ({"prompt": "x", "logprobs": 21}, (400, IV, "logprobs")),
    "B24 negative": ({"prompt": [-1]}, (400, IV, "prompt")),
    "B24 vocab": ({"prompt": [1000]}, (400, IV, "prompt")),
    "B24 2**31": ({"prompt": [2**31]}, (400, IV, "prompt")),
    "B24 nested": ({"prompt": [[1, 2], [5000]]}, (400, IV, "prompt")),
    "B26 huge prompt": ({"prompt": "x" * 1_000_001}, (413, "prompt_too_large", "prompt")),
    "B26 huge batch": ({"prompt": ["x" * 600_000] * 2}, (413, "prompt_too_large", "prompt")),
    "B37 best_of": ({"prompt": "x", "best_of": 2}, (400, "unknown_parameter", "best_of")),
    "B37 best_of 0": ({"prompt": "x", "best_of": 0}, (400, "unknown_parameter", "best_of")),
    "B12 max_tokens 0 without echo": ({"prompt": "x", "max_tokens": 0}, (400, IV, "max_tokens")),
    "B12 max_tokens -1 with echo": (
        {"prompt": "x", "max_tokens": -1, "echo": True},
        (400, IV, "max_tokens"),
    ),
    "B14 logprobs 1.5": ({"prompt": "x", "logprobs": 1.5}, (400, IT, "logprobs")),
    "B38 chat fields": ({"prompt": "x", "messages": MSG}, (400, "unknown_parameter", "messages")),
    "suffix": ({"prompt": "x", "suffix": "y"}, (400, "unsupported_parameter", "suffix")),
}


def test_schema_meta_validation_never_fetches_and_never_crashes(monkeypatch):
    """An unknown `$schema` is checked as Draft 2020-12 without being fetched (the native
    validator would try the URL); a schema nested past the body cap's depth, which only a
    caller other than the HTTP parser could hand over, is a 400 before the native code."""
    import jsonschema_rs

    from ultrafast.server import client_schema as protocol

    seen = []
    real = jsonschema_rs.meta.validate
    monkeypatch.setattr(
        protocol.jsonschema_rs.meta, "validate", lambda schema: (seen.append(schema), real(schema))
    )
    ok = chat(response_format=schema_format({"$schema": "http://example.com/s", "type": "string"}))
    parse_chat_request(ok, ALL_FEATURES)
    assert seen and all("$schema" not in s for s in seen)
    known = "https://json-schema.org/draft/2020-12/schema"
    parse_chat_request(chat(response_format=schema_format({"$schema": known})), ALL_FEATURES)
    assert seen[-1]["$schema"] == known
    for levels in (100, 20_000):  # past the 64 the body parser allows; past json's recursion
        deep: dict = {"type": "integer"}
        for _ in range(levels):
            deep = {"type": "array", "items": deep}
        with pytest.raises(APIError) as info:
            protocol.check_client_schema(deep, "response_format", ALL_FEATURES, "response_format")
        # the path names where the limit is passed: the 65th level, under 64 `items`
        expected = "response_format" + ".items" * 64
        assert (info.value.status, info.value.param) == (400, expected)
        assert "nested more than 64 deep" in info.value.message


def test_a_schema_that_passed_is_not_checked_again_and_a_bad_one_always_is(monkeypatch):
    import jsonschema_rs

    from ultrafast.server import client_schema as protocol

    calls = []
    real = jsonschema_rs.meta.validate
    monkeypatch.setattr(protocol, "_PASSED_SCHEMAS", protocol._RecentDigests(2))
    monkeypatch.setattr(
        protocol.jsonschema_rs.meta, "validate", lambda schema: (calls.append(1), real(schema))
    )
    good = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for _ in range(3):  # an agent's tool schema, every turn
        parse_chat_request(chat(tools=[tool("f", good)]), ALL_FEATURES)
    assert len(calls) == 1
    bad = {"type": "object", "properties": {"a": {"type": "integer", "minimum": "0"}}}
    for _ in range(2):
        assert refusal(parse_chat_request, chat(tools=[tool("f", bad)]), ALL_FEATURES) == (
            400,
            IV,
            "tools[0].function.parameters.properties.a.minimum",
        )
    assert len(calls) == 3
    unsupported = {"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}
    for _ in range(2):  # valid by the meta-schema, not enforceable: refused every time
        body = chat(response_format=schema_format(unsupported))
        assert refusal(parse_chat_request, body, ALL_FEATURES)[2] == (
            "response_format.json_schema.schema.properties.a.uniqueItems"
        )
    for i in range(3):  # the set is bounded: the first schema has been forgotten
        parse_chat_request(chat(tools=[tool("f", {**good, "title": str(i)})]), ALL_FEATURES)
    parse_chat_request(chat(tools=[tool("f", good)]), ALL_FEATURES)
    assert len(calls) == 3 + 2 + 3 + 1


@pytest.mark.parametrize("case", sorted(COMPLETION_CASES))
def test_completion_refusals(case):
    body, expected = COMPLETION_CASES[case]
    assert refusal(parse_completion_request, body) == expected


@pytest.mark.parametrize(
    "field,value",
    [
        ("tools", [tool()]),
        ("response_format", {"type": "json_object"}),
        ("response_format", schema_format({"type": "object"})),
        ("session_id", "abc-123_x"),
    ],
)
def test_validated_features_are_refused_until_the_server_enables_them(field, value):
    assert refusal(parse_chat_request, chat(**{field: value})) == (
        400,
        "unsupported_parameter",
        field,
    )
    parse_chat_request(chat(**{field: value}), ALL_FEATURES)


def test_b15_refused_without_work_in_proportion_to_n():
    """Traced memory, not wall-clock time (which the machine's load stretches): a million
    choices built before the refusal would take megabytes."""
    refusal(parse_chat_request, chat(n=9))  # validators built, caches warm
    tracemalloc.start()
    try:
        assert refusal(parse_chat_request, chat(n=1_000_000))[2] == "n"
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024


FULL_CHAT = {
    "model": "m",
    "messages": [
        {"role": "system", "content": "be brief"},
        {
            "role": "developer",
            "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
        },
        {"role": "user", "content": "hi", "name": "ann"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get", "arguments": '{"q": 1}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
    ],
    "max_completion_tokens": 33,
    "max_tokens": 40,
    "temperature": 0.5,
    "top_p": 0.9,
    "top_k": 40,
    "min_p": 0.05,
    "n": 2,
    "stop": ["\n\n"],
    "seed": 7,
    "presence_penalty": 0.5,
    "frequency_penalty": -0.5,
    "repetition_penalty": 1.1,
    "logit_bias": {"5": -100, "2": 3},
    "logprobs": True,
    "top_logprobs": 3,
    "user": "u",
    "stream": True,
    "stream_options": {"include_usage": True},
    "service_tier": "ultrafast",
    "prediction": {"type": "content", "content": "the answer"},
    "response_format": schema_format({"type": "object", "properties": {"a": {"type": "string"}}}),
    "tools": [tool("get", {"type": "object", "properties": {"q": {"type": "integer"}}})],
    "tool_choice": {"type": "function", "function": {"name": "get"}},
    "parallel_tool_calls": False,
    "session_id": "sess_1",
    "ignore_eos": True,
    "metadata": {"k": "v"},
    "store": False,
}


def test_full_chat_request_maps_to_sampling_params():
    req = parse_chat_request(FULL_CHAT, ALL_FEATURES)
    p = req.sampling_params(ALL_FEATURES.vocab_size, 100)
    assert p == SamplingParams(
        max_tokens=33,
        temperature=0.5,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        seed=7,
        repetition_penalty=1.1,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        logit_bias=((2, 3.0), (5, -100.0)),
        logprobs=True,
        top_logprobs=3,
        ignore_eos=True,
    )
    assert req.tier() == ServiceTier.PRIORITY and req.include_usage() and req.n == 2
    assert req.stop_list() == ["\n\n"] and req.requested_max_tokens() == 33
    assert req.prediction_text() == "the answer" and req.session_id == "sess_1"
    assert req.tools_for_template()[0]["function"]["name"] == "get"
    assert req.messages_for_template() == [
        {"role": "system", "content": "be brief"},
        {"role": "developer", "content": "a\nb"},
        {"role": "user", "content": "hi", "name": "ann"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get", "arguments": '{"q": 1}'},
                }
            ],
        },
        {"role": "tool", "content": "42", "tool_call_id": "call_1"},
    ]


FULL_COMPLETION = {
    "model": "m",
    "prompt": [[1, 2, 3], [4]],
    "max_tokens": 20,
    "temperature": 0,
    "top_p": 0.5,
    "top_k": -1,
    "min_p": 0.1,
    "n": 3,
    "stop": "END",
    "seed": 2**64 - 1,
    "presence_penalty": 2,
    "frequency_penalty": -2,
    "repetition_penalty": 10,
    "logit_bias": {"999": 100},
    "logprobs": 5,
    "user": "u",
    "stream": False,
    "service_tier": "flex",
    "echo": True,
    "ignore_eos": False,
    "metadata": {},
    "store": True,
}


def test_full_completion_request_maps_to_sampling_params():
    req = parse_completion_request(FULL_COMPLETION, LIMITS)
    p = req.sampling_params(LIMITS.vocab_size, 100)
    assert p == SamplingParams(
        max_tokens=20,
        temperature=0.0,
        top_p=0.5,
        top_k=0,
        min_p=0.1,
        seed=2**64 - 1,
        repetition_penalty=10.0,
        presence_penalty=2.0,
        frequency_penalty=-2.0,
        logit_bias=((999, 100.0),),
        logprobs=True,
        top_logprobs=5,
        prompt_logprobs=5,
    )
    assert p.greedy and req.tier() == ServiceTier.FLEX and req.echo and not req.stream
    assert req.prompt_list() == [[1, 2, 3], [4]] and req.stop_list() == ["END"]


def test_defaults_follow_openai():
    req = parse_chat_request(chat(), LIMITS)
    p = req.sampling_params(LIMITS.vocab_size, 77)
    assert p == SamplingParams(max_tokens=77, temperature=1.0)
    assert req.tier() == ServiceTier.DEFAULT and req.n == 1 and not req.stream
    assert req.stop_list() == [] and not req.include_usage()


def test_nulls_mean_not_sent():
    body = chat(
        n=None,
        stream=None,
        stop=None,
        temperature=None,
        stream_options=None,
        logprobs=None,
        tools=None,
        service_tier=None,
    )
    req = parse_chat_request(body, LIMITS)
    assert req.n == 1 and req.sampling_params(1000, 5).temperature == 1.0


@pytest.mark.parametrize("top_k,expected", [(-1, 0), (0, 0), (1, 1), (999, 999), (10**9, 0)])
def test_top_k_off_values(top_k, expected):
    req = parse_chat_request(chat(top_k=top_k), LIMITS)
    assert req.sampling_params(LIMITS.vocab_size, 5).top_k == expected


@pytest.mark.parametrize(
    "name,tier",
    [
        ("auto", ServiceTier.DEFAULT),
        ("default", ServiceTier.DEFAULT),
        ("flex", ServiceTier.FLEX),
        ("priority", ServiceTier.PRIORITY),
        ("ultrafast", ServiceTier.PRIORITY),
    ],
)
def test_tiers_and_priority_alias(name, tier):
    assert parse_chat_request(chat(service_tier=name), LIMITS).tier() == tier
    req = parse_chat_request(chat(priority=name), LIMITS)
    assert req.tier() == tier and req.requested_tier_name() == name


def test_completion_prompt_forms():
    def prompts(p):
        return parse_completion_request({"prompt": p}, LIMITS).prompt_list()

    assert prompts("a") == ["a"] and prompts(["a", "b"]) == ["a", "b"]
    assert prompts([1, 2]) == [[1, 2]] and prompts([[1], [2, 999]]) == [[1], [2, 999]]
    assert prompts([[1, 2], "a"]) == [[1, 2], "a"]  # a mixed batch, as vLLM accepts
    req = parse_completion_request({"prompt": "a", "logprobs": 0}, LIMITS)
    p = req.sampling_params(1000, 5)
    assert p.logprobs and p.top_logprobs == 0


def test_floats_accept_ints_and_edges():
    req = parse_chat_request(
        chat(
            temperature=2,
            top_p=1,
            min_p=0,
            frequency_penalty=-2,
            max_tokens=512,
            top_logprobs=20,
            logprobs=True,
        ),
        LIMITS,
    )
    p = req.sampling_params(1000, 5)
    assert (p.temperature, p.top_p, p.max_tokens, p.top_logprobs) == (2.0, 1.0, 512, 20)
    assert parse_chat_request(
        chat(
            stop=["a", "b", "c", "d"],
            tool_choice="none",
            logit_bias={str(i): 0 for i in range(300)},
        ),
        LIMITS,
    )
