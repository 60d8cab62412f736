"""Schemas we cannot enforce are refused with the keyword's path (grammar/schema_check.py)."""

import json
from pathlib import Path

import pytest

from ultrafast.grammar.schema_check import MAX_DEPTH, SchemaProblem, check_schema

SCHEMAS = json.loads((Path(__file__).parents[1] / "data" / "grammar_schemas.json").read_text())


def problem(schema) -> SchemaProblem:
    with pytest.raises(SchemaProblem) as info:
        check_schema(schema)
    return info.value


def obj(**props):
    return {"type": "object", "properties": props}


@pytest.mark.parametrize("entry", SCHEMAS, ids=[e["name"] for e in SCHEMAS])
def test_the_shipped_schemas_pass(entry):
    check_schema(entry["schema"])


@pytest.mark.parametrize(
    "schema,path,code",
    [
        (
            obj(x={"type": "string", "not": {"const": "a"}}),
            "properties.x.not",
            "unsupported_schema",
        ),
        ({"type": "array", "uniqueItems": True}, "uniqueItems", "unsupported_schema"),
        (
            obj(a=obj(b={"if": {}, "then": {}})),
            "properties.a.properties.b.if",
            "unsupported_schema",
        ),
        ({"anyOf": [{"type": "null"}, {"propertyNames": {}}]}, "anyOf[1].propertyNames", None),
        (obj(d={"type": "string", "format": "iri"}), "properties.d.format", "unsupported_schema"),
        ({"$ref": "https://example.com/s.json"}, "$ref", "unsupported_schema"),
        (obj(r={"$ref": "#/$defs/missing"}), "properties.r.$ref", "invalid_schema"),
        ({"items": [{"type": "integer"}, {"contains": {}}]}, "items[1].contains", None),
    ],
)
def test_unsupported_keywords_are_named_by_path(schema, path, code):
    p = problem(schema)
    assert p.path == path
    assert p.param("response_format.json_schema.schema") == (
        "response_format.json_schema.schema." + path
    )
    if code:
        assert p.code == code


def test_a_ref_to_itself_with_no_way_out_is_a_cycle():
    assert problem({"$ref": "#"}).path == "$ref"
    chain = {
        "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"allOf": [{"$ref": "#/$defs/a"}]}},
        **obj(x={"$ref": "#/$defs/a"}),
    }
    assert "cycle" in str(problem(chain))
    required_self = {
        "$defs": {"n": {**obj(next={"$ref": "#/$defs/n"}), "required": ["next"]}},
        "$ref": "#/$defs/n",
    }
    assert "cycle" in str(problem(required_self))


def test_recursion_with_a_base_case_is_allowed():
    tree = {
        "$defs": {
            "node": {
                **obj(
                    v={"type": "integer"}, kids={"type": "array", "items": {"$ref": "#/$defs/node"}}
                ),
                "required": ["v"],
            }
        },
        "$ref": "#/$defs/node",
    }
    check_schema(tree)


def test_huge_enums_deep_nesting_and_slow_patterns():
    assert problem(obj(e={"enum": list(range(5000))})).path == "properties.e.enum"
    assert problem(obj(e={"enum": ["x" * 2000] * 10})).path == "properties.e.enum"
    deep: dict = {"type": "integer"}
    for _ in range(MAX_DEPTH + 2):
        deep = obj(a=deep)
    assert "nests deeper" in str(problem(deep))
    assert problem(obj(p={"type": "string", "pattern": "a{5000}"})).path == "properties.p.pattern"
    assert (
        problem(obj(p={"type": "string", "pattern": "(ab)" * 400})).path == "properties.p.pattern"
    )
    assert problem({"patternProperties": {"x{1,99999}": {}}}).path == "patternProperties.x{1,99999}"
    # not a regular expression at all: named by its path too
    assert problem(obj(p={"type": "string", "pattern": "(ab"})).path == "properties.p.pattern"
    assert problem({"patternProperties": {"[a-": {}}}).path == "patternProperties.[a-"
