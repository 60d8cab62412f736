"""JSON schemas as our own Lark rules (grammar/json_lark.py) on the demo model's vocabulary:
the bounds JSON has (int64 integers, 17 significant digits, a bounded exponent, maxLength,
maxItems, maxProperties, no free whitespace), empty languages refused with the keyword's
path, and random walks through each grammar of the 50-schema set ending only in JSON that
validates."""

from __future__ import annotations

import json
import random
from pathlib import Path

import jsonschema
import llguidance
import numpy as np
import pytest

from ultrafast.config import DEMO_MODEL_DIR
from ultrafast.grammar import GrammarSpec
from ultrafast.grammar.min_length import min_chars, pattern_min_width
from ultrafast.grammar.schema_check import SchemaProblem

SCHEMAS = json.loads((Path(__file__).parents[1] / "data" / "grammar_schemas.json").read_text())


@pytest.fixture(scope="module")
def tok():
    return llguidance.LLTokenizer(str(DEMO_MODEL_DIR / "tokenizer.json"))


def matcher(tok, schema) -> llguidance.LLMatcher:
    m = llguidance.LLMatcher(tok, GrammarSpec.from_json_schema(schema).lark, log_level=0)
    assert not m.is_error(), m.get_error()
    return m


def complete(tok, schema, text: str) -> bool:
    """The grammar accepts `text` as a whole answer (end-of-sequence may follow)."""
    m = matcher(tok, schema)
    return m.consume_tokens(tok.tokenize_str(text)) and m.is_accepting()


def obj(**props):
    return {
        "type": "object",
        "properties": props,
        "required": list(props),
        "additionalProperties": False,
    }


def test_unbounded_integer_is_int64(tok):
    s = obj(n={"type": "integer"})
    assert complete(tok, s, '{"n":9223372036854775807}')
    assert complete(tok, s, '{"n":-9223372036854775808}')
    assert not complete(tok, s, '{"n":9223372036854775808}')
    assert not complete(tok, s, '{"n":123456789012345678901}')
    assert not complete(tok, s, '{"n":007}')


def test_integer_range_uses_only_its_digits(tok):
    s = obj(n={"type": "integer", "minimum": 1, "exclusiveMaximum": 250})
    assert all(complete(tok, s, f'{{"n":{v}}}') for v in (1, 9, 10, 99, 100, 249))
    assert not any(complete(tok, s, f'{{"n":{v}}}') for v in (0, -1, 250, 1000, 2490))


def test_numbers_have_17_significant_digits_and_a_bounded_exponent(tok):
    s = obj(x={"type": "number"})
    assert complete(tok, s, '{"x":1.2345678901234567}')
    assert not complete(tok, s, '{"x":1.23456789012345678}')
    assert complete(tok, s, '{"x":-2.5e-308}')
    assert not complete(tok, s, '{"x":1e309}')
    assert not complete(tok, s, '{"x":1e1000}')


def test_number_range_is_kept_with_bounded_decimals(tok):
    s = obj(lat={"type": "number", "minimum": -90, "maximum": 90})
    assert all(complete(tok, s, f'{{"lat":{v}}}') for v in ("-90", "90", "-45.25", "89.999"))
    assert not any(complete(tok, s, f'{{"lat":{v}}}') for v in ("90.5", "-90.1", "91", "1e2"))
    assert not complete(tok, s, '{"lat":1.' + "1" * 30 + "}")
    price = obj(p={"type": "number", "exclusiveMinimum": 0})
    assert complete(tok, price, '{"p":0.5}') and not complete(tok, price, '{"p":0}')


def test_lengths_items_and_properties_are_enforced(tok):
    s = obj(
        s={"type": "string", "maxLength": 3},
        a={"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 2},
    )
    assert complete(tok, s, '{"s":"abc","a":[true,false]}')
    assert not complete(tok, s, '{"s":"abcd","a":[true]}')
    assert not complete(tok, s, '{"s":"a","a":[]}')
    assert not complete(tok, s, '{"s":"a","a":[true,true,true]}')
    bag = {"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 2}
    assert complete(tok, bag, '{"x":1,"y":2}') and complete(tok, bag, "{}")
    assert not complete(tok, bag, '{"x":1,"y":2,"z":3}')


def test_no_whitespace_between_tokens(tok):
    s = obj(a={"type": "integer"}, b={"type": "array", "items": {"type": "integer"}})
    assert complete(tok, s, '{"a":1,"b":[1,2]}')
    for spaced in ('{ "a":1,"b":[]}', '{"a": 1,"b":[]}', '{"a":1, "b":[]}', '{"a":1,"b":[1, 2]}'):
        assert not complete(tok, s, spaced), spaced
    assert not complete(tok, {"type": "object"}, '{"k": 1}')


def test_listed_properties_never_repeat_as_other_keys(tok):
    s = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    assert complete(tok, s, '{"a":1,"b":"x"}')
    assert not complete(tok, s, '{"a":1,"a":2}')


@pytest.mark.parametrize(
    ("schema", "path"),
    [
        (obj(v={"type": "integer", "minimum": 5, "maximum": 4}), "properties.v.minimum"),
        (obj(v={"type": "number", "minimum": 1, "exclusiveMaximum": 1}), "properties.v.minimum"),
        (obj(v={"type": "string", "minLength": 3, "maxLength": 2}), "properties.v.minLength"),
        (obj(v={"type": "string", "enum": [1, 2]}), "properties.v.enum"),
        (obj(v={"type": "array", "minItems": 3, "maxItems": 2}), "properties.v.minItems"),
        (obj(v={"type": "string", "pattern": "^a{4}$", "maxLength": 3}), "properties.v.pattern"),
        (obj(v=False), "properties.v"),
        (
            {"type": "object", "properties": {}, "required": ["x"], "additionalProperties": False},
            "required",
        ),
        ({"type": "object", "required": ["a", "b"], "maxProperties": 1}, "maxProperties"),
    ],
)
def test_empty_languages_name_their_keyword(schema, path):
    with pytest.raises(SchemaProblem) as info:
        GrammarSpec.from_json_schema(schema)
    assert info.value.path == path


def test_shortest_answer_and_its_keyword():
    assert pattern_min_width("^(a{999}){999}$") == 998001
    chars, (_, path) = min_chars(obj(zip={"type": "string", "pattern": "^(a{999}){999}$"}))
    assert chars > 998001 and path == "properties.zip.pattern"
    assert min_chars(obj(a={"type": "integer"}))[0] == len('{"a":0}')
    spec = GrammarSpec.from_json_schema(obj(v={"type": "string", "minLength": 5000}))
    assert spec.min_chars > 5000 and spec.min_path == "properties.v.minLength"


def walk(tok, schema, rng: random.Random, steps: int = 200) -> str | None:
    """Random allowed tokens until the grammar may end (then end with probability 1/3);
    the text, or None if it did not end within `steps`."""
    m, out = matcher(tok, schema), []
    for _ in range(steps):
        bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), np.uint8), bitorder="little")
        allowed = np.flatnonzero(bits[: tok.vocab_size]).tolist()
        if tok.eos_token in allowed and (len(allowed) == 1 or rng.random() < 1 / 3):
            return b"".join(tok.decode_bytes([t]) for t in out).decode()
        token = rng.choice([t for t in allowed if t != tok.eos_token])
        assert m.consume_token(token), m.get_error()
        out.append(token)
    return None


def test_random_walks_through_every_schema_end_in_valid_json(tok):
    rng = random.Random(7)
    ended = 0
    for case in SCHEMAS:
        for _ in range(2):
            text = walk(tok, case["schema"], rng)
            if text is not None:
                ended += 1
                jsonschema.validate(json.loads(text), case["schema"])
    assert ended >= len(SCHEMAS)  # most walks end: every grammar's lengths are bounded
