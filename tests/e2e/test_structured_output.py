"""response_format / text.format against the real server on the demo model, through the
official `openai` client and raw HTTP; bad schemas answer 400 with the keyword's path."""

from __future__ import annotations

import json
import uuid
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "days", "unit"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Weather in Paris for 3 days, as JSON."}]


class Forecast(BaseModel):
    city: str = Field(max_length=12)
    days: int = Field(ge=1, le=14)
    unit: Literal["celsius", "fahrenheit"]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def post(server, body, path="/v1/chat/completions"):
    return httpx.post(server.url + path, json=body, timeout=120)


def schema_format(schema, strict=True):
    return {
        "type": "json_schema",
        "json_schema": {"name": "out", "schema": schema, "strict": strict},
    }


@pytest.mark.parametrize("strict", [True, False])
def test_json_schema_greedy_and_sampled(server, strict):
    for temperature in (0.0, 1.0):
        body = {
            "messages": MESSAGES,
            "max_tokens": 120,
            "temperature": temperature,
            "seed": 3,
            "response_format": schema_format(SCHEMA, strict),
        }
        r = post(server, body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)


def test_json_object_streamed_equals_a_json_object(client):
    stream = client.chat.completions.create(
        model="demo-code",
        messages=MESSAGES,
        max_tokens=200,
        temperature=0.0,
        response_format={"type": "json_object"},
        stream=True,
    )
    text, reasons = "", []
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            reasons.append(chunk.choices[0].finish_reason)
    if reasons[-1] == "stop":  # an object can be long: only a finished one must parse
        assert isinstance(json.loads(text), dict)
    assert text.startswith("{")


def test_the_official_client_parses_a_pydantic_model(client):
    completion = client.chat.completions.parse(
        model="demo-code",
        messages=MESSAGES,
        max_tokens=120,
        temperature=0.0,
        response_format=Forecast,
    )
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Forecast) and 1 <= parsed.days <= 14


def test_responses_api_text_format(server, client):
    fmt = {"type": "json_schema", "name": "forecast", "schema": SCHEMA, "strict": True}
    r = post(
        server,
        {
            "input": "Weather in Oslo?",
            "max_output_tokens": 120,
            "temperature": 0,
            "store": False,
            "text": {"format": fmt},
        },
        "/v1/responses",
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["text"]["format"]["name"] == "forecast"
    jsonschema.validate(json.loads(body["output"][0]["content"][0]["text"]), SCHEMA)
    parsed = client.responses.parse(
        model="demo-code",
        input="Weather?",
        max_output_tokens=120,
        temperature=0,
        store=False,
        text_format=Forecast,
    )
    assert isinstance(parsed.output_parsed, Forecast)


def prop(**schema):
    return {"type": "object", "properties": {"x": schema}}


@pytest.mark.parametrize(
    "schema,code,param",
    [
        (prop(type="string", pattern="a{9999}"), "invalid_schema", "properties.x.pattern"),
        (prop(type="string", format="iri"), "unsupported_schema", "properties.x.format"),
        (prop(type="array", uniqueItems=True), "unsupported_schema", "properties.x.uniqueItems"),
        ({"$ref": "#"}, "invalid_schema", "$ref"),
        (prop(enum=list(range(3000))), "invalid_schema", "properties.x.enum"),
        (
            {
                "type": "object",
                "minProperties": 2,
                "properties": {"a": {}},
                "additionalProperties": False,
            },
            "invalid_schema",
            "minProperties",
        ),
        (
            {**prop(type="string", minLength=9, maxLength=2), "required": ["x"]},
            "invalid_schema",
            "properties.x.minLength",
        ),
    ],
)
def test_bad_schemas_are_400_with_the_keywords_path(server, schema, code, param):
    for path, body in (
        ("/v1/chat/completions", {"messages": MESSAGES, "response_format": schema_format(schema)}),
        (
            "/v1/responses",
            {
                "input": "x",
                "store": False,
                "text": {"format": {"type": "json_schema", "name": "s", "schema": schema}},
            },
        ),
    ):
        r = post(server, body, path)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        prefix = "response_format.json_schema.schema" if "chat" in path else "text.format.schema"
        assert error["code"] == code and error["param"] == (
            f"{prefix}.{param}" if param else prefix
        )
    # nothing else is affected
    ok = post(server, {"messages": MESSAGES, "max_tokens": 4})
    assert ok.status_code == 200


def test_a_schema_invalid_by_its_meta_schema_is_400_on_both_apis(server):
    schema = prop(type="string", minLength=-1)
    for path, body, param in (
        (
            "/v1/chat/completions",
            {"messages": MESSAGES, "response_format": schema_format(schema)},
            "response_format.json_schema.schema.properties.x.minLength",
        ),
        (
            "/v1/responses",
            {
                "input": "x",
                "store": False,
                "text": {"format": {"type": "json_schema", "name": "s", "schema": schema}},
            },
            "text.format.schema.properties.x.minLength",
        ),
    ):
        r = post(server, body, path)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert (error["code"], error["param"]) == ("invalid_value", param)
        assert "properties.x.minLength" in error["message"]


def test_deep_nesting_is_refused(server):
    schema: dict = {"type": "integer"}
    for _ in range(40):
        schema = {"type": "array", "items": schema}  # one JSON level each: under the body cap
    r = post(server, {"messages": MESSAGES, "response_format": schema_format(schema)})
    assert r.status_code == 400 and "nests deeper" in r.json()["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_schema_that_fails_to_compile_is_a_400_before_any_stream_byte(server, stream):
    # first seen (a fresh property name): it compiles while the request is submitted, and the
    # failure still answers a plain 400, not an event stream
    name = f"n{int(stream)}{uuid.uuid4().hex[:8]}"
    schema = {**prop(type="integer", minimum=9, maximum=2), "required": ["x"], "title": name}
    body = {
        "messages": MESSAGES,
        "max_tokens": 8,
        "stream": stream,
        "response_format": schema_format(schema),
    }
    r = post(server, body)
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json")
    assert r.json()["error"]["code"] == "invalid_schema"
    ok = post(server, {**body, "response_format": schema_format(SCHEMA)})
    assert ok.status_code == 200
