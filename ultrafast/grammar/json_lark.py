"""A JSON schema as llguidance Lark rules that bound what JSON bounds.

llguidance's `%json` lets a model write an 80-digit integer, a latitude with hundreds of
decimals, or keys without end; a small model then runs to max_tokens and the answer is not
JSON. Here the common shapes become our own rules: integers with only the digits their range
allows (int64 when unbounded), numbers with at most 17 significant digits and a bounded
exponent (json_numbers.py), strings within minLength/maxLength, arrays within
minItems/maxItems, objects in their properties' order with minProperties/maxProperties
counted, no whitespace (one compact spelling), enums and consts as their values. What is not
one of these shapes (a `pattern`, a `format`, `allOf`, `oneOf`, `prefixItems`,
`patternProperties`) is handed to llguidance as an inline `%json` of that subschema; a schema
with a `$ref` anywhere goes to llguidance whole (its refs need the root).

A subschema whose language is empty raises SchemaProblem with its path, so the client gets a
400 naming it before anything is generated.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema_rs

from ultrafast.grammar import json_numbers as num
from ultrafast.grammar.min_length import pattern_min_width
from ultrafast.grammar.schema_check import SchemaProblem

JSON_OPTIONS = {"item_separator": ",", "key_separator": ":", "whitespace_flexible": False}
MAX_COUNTED = 64  # maxItems / maxProperties spelled as rules; larger goes to llguidance
MAX_STRING_BOUND = 1000  # a larger maxLength goes to llguidance
_CHAR = r'(?:[^"\\\x00-\x1f]|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))'
_ANNOTATIONS = frozenset(
    {"title", "description", "default", "examples", "$comment", "$schema", "$id", "id",
     "readOnly", "writeOnly", "deprecated", "contentMediaType", "contentEncoding",
     "$anchor", "$defs", "definitions", "x-guidance", "strict", "nullable"}
)  # fmt: skip
_TYPED = {
    "string": frozenset({"minLength", "maxLength"}),
    "integer": frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}),
    "number": frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}),
    "boolean": frozenset(),
    "null": frozenset(),
    "array": frozenset({"items", "minItems", "maxItems"}),
    "object": frozenset(
        {"properties", "required", "additionalProperties", "minProperties", "maxProperties"}
    ),
}
_ALL_TYPED = frozenset().union(*_TYPED.values())


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _rx(regex: str) -> str:
    return "/" + regex.replace("/", "\\/") + "/"


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _has_ref(node: Any) -> bool:
    if isinstance(node, dict):
        return "$ref" in node or any(_has_ref(v) for v in node.values())
    if isinstance(node, list):
        return any(_has_ref(v) for v in node)
    return False


def embedded_json(schema: Any) -> str:
    """`%json {schema}` with our compact spelling pinned (llguidance's own compiler)."""
    if isinstance(schema, dict):
        schema = {**schema, "x-guidance": {**JSON_OPTIONS, **schema.get("x-guidance", {})}}
    else:
        schema = {"x-guidance": JSON_OPTIONS} if schema else {"not": {}}
    return "%json " + _compact(schema)


class JsonLark:
    """Rules for one or more schemas in one grammar; `prefix` keeps rule names apart."""

    def __init__(self, prefix: str = "j_"):
        self.prefix = prefix
        self.rules: list[str] = []
        self._named: dict[str, str] = {}  # rule body -> name (shared bodies)
        self._any: str | None = None

    def schema(self, schema: Any) -> str:
        """The expression for one value matching `schema` (rules added to `self.rules`)."""
        if _has_ref(schema):
            return embedded_json(schema)
        return self.value(schema, "")

    def _rule(self, body: str, terminal: bool = False) -> str:
        key = ("T" if terminal else "r") + body
        if key not in self._named:
            n = len(self._named)
            name = f"{self.prefix.upper()}T{n}" if terminal else f"{self.prefix}r{n}"
            self._named[key] = name
            self.rules.append(f"{name}: {body}")
        return self._named[key]

    def _terminal(self, regex: str) -> str:
        return self._rule(_rx(regex), terminal=True)

    # ---- dispatch --------------------------------------------------------------------------

    def value(self, node: Any, path: str) -> str:
        if node is True or node == {}:
            return self.any_value()
        if node is False:
            raise SchemaProblem(path, "this subschema is `false`: no value matches it")
        if not isinstance(node, dict):
            return embedded_json(node)
        if "enum" in node or "const" in node:
            return self._enum(node, path)
        keys = set(node) - _ANNOTATIONS
        if not keys:
            return self.any_value()
        if keys == {"anyOf"} and isinstance(node["anyOf"], list) and node["anyOf"]:
            return self._alternatives(
                [self.value(s, f"{path}.anyOf[{i}]" if path else f"anyOf[{i}]")
                 for i, s in enumerate(node["anyOf"])]
            )  # fmt: skip
        kind = node.get("type")
        if isinstance(kind, list) and kind and keys <= _ALL_TYPED | {"type"}:
            return self._alternatives([self.value({**node, "type": k}, path) for k in kind])
        if not isinstance(kind, str) or kind not in _TYPED or not keys <= _TYPED[kind] | {"type"}:
            _check_pattern_fits(node, path)
            return embedded_json(node)  # llguidance's own compiler
        return getattr(self, "_" + kind)(node, path)

    def _alternatives(self, exprs: list[str]) -> str:
        return self._rule(" | ".join(dict.fromkeys(exprs)))

    # ---- scalars ---------------------------------------------------------------------------

    def _enum(self, node: dict, path: str) -> str:
        key = "const" if "const" in node else "enum"
        values = [node["const"]] if key == "const" else node["enum"]
        rest = {k: v for k, v in node.items() if k not in ("enum", "const")}
        where = f"{path}.{key}" if path else key
        try:
            validator = jsonschema_rs.validator_for(rest)
            ok = [v for v in values if validator.is_valid(v)]
        except Exception:  # a schema the validator cannot build: keep every value
            ok = list(values)
        if not ok:
            raise SchemaProblem(where, f"no value of {key} matches the rest of its schema")
        return self._alternatives([_lit(_compact(v)) for v in ok])

    def _string(self, node: dict, path: str) -> str:
        low, high = node.get("minLength", 0), node.get("maxLength")
        if high is not None and high > MAX_STRING_BOUND:
            return embedded_json(node)
        if high is not None and low > high:
            raise SchemaProblem(_at(path, "minLength"), "minLength is larger than maxLength")
        count = f"{{{low},{'' if high is None else high}}}"
        return self._terminal(f'"{_CHAR}{count}"' if count != "{0,}" else f'"{_CHAR}*"')

    def _integer(self, node: dict, path: str) -> str:
        lo, hi = num.integer_bounds(*_bounds(node))
        if lo > hi:
            raise SchemaProblem(_at(path, "minimum"), "no integer lies within these bounds")
        return self._terminal(num.int_range(lo, hi))

    def _number(self, node: dict, path: str) -> str:
        bounds = _bounds(node)
        if not any(b is not None for b in bounds[:2]):
            return self._terminal(num.significant())
        low, high = bounds[:2]
        if low is not None and high is not None and (low > high or low == high and any(bounds[2:])):
            raise SchemaProblem(_at(path, "minimum"), "no number lies within these bounds")
        ranged = num.number_range(*bounds)
        if ranged is None:  # narrower than one integer: llguidance's own number
            return embedded_json(node)
        return self._rule(f"{_rx(ranged)} & {_rx(num.significant())}", terminal=True)

    def _boolean(self, node: dict, path: str) -> str:
        return self._rule('"true" | "false"')

    def _null(self, node: dict, path: str) -> str:
        return '"null"'

    # ---- containers ------------------------------------------------------------------------

    def _array(self, node: dict, path: str) -> str:
        low, high = node.get("minItems", 0), node.get("maxItems")
        if high is not None and low > high:
            raise SchemaProblem(_at(path, "minItems"), "minItems is larger than maxItems")
        if high is not None and high > MAX_COUNTED or low > MAX_COUNTED:
            return embedded_json(node)
        item = self.value(node.get("items", True), _at(path, "items"))
        if high == 0:
            return '"[" "]"'
        more = self._repeat(f'"," {item}', max(low - 1, 0), None if high is None else high - 1)
        first = f"{item} {more}".strip()
        return self._rule(f'"[" {first} "]"' if low else f'"[" ({first})? "]"')

    def _repeat(self, item: str, low: int, high: int | None) -> str:
        """`item` low..high times (None: no upper bound)."""
        required = " ".join([item] * low)
        if high is None:
            return f"{required} ({item})*".strip()
        optional = ""
        for _ in range(high - low):  # nested: (item (item ...)?)?
            optional = self._rule(f"({item} {optional})?".replace(" )", ")"))
        return f"{required} {optional}".strip()

    def _object(self, node: dict, path: str) -> str:
        props = node.get("properties") or {}
        required = [k for k in node.get("required", []) if isinstance(k, str)]
        extra = node.get("additionalProperties", True)
        missing = [k for k in required if k not in props]
        if missing and extra is False:
            raise SchemaProblem(
                _at(path, "required"), f"required {missing[0]!r} is not an allowed property"
            )
        low, high = node.get("minProperties", 0), node.get("maxProperties")
        if high is not None and (low > high or len(set(required)) > high):
            raise SchemaProblem(_at(path, "maxProperties"), "too few properties are allowed")
        if missing or len(props) > MAX_COUNTED or (high or 0) > MAX_COUNTED or low > MAX_COUNTED:
            return embedded_json(node)
        entries = [
            (self._key(k), self.value(v, _at(_at(path, "properties"), k)), k in required)
            for k, v in props.items()
        ]
        extra_entry = None
        if extra is not False:
            key = self._other_key(list(props))
            extra_entry = (key, self.value(extra, _at(path, "additionalProperties")))
        walk = _ObjectWalk(self, entries, extra_entry, low, high)
        if not walk.feasible(0, 0):
            raise SchemaProblem(_at(path, "minProperties"), "too many properties are required")
        return self._rule(f'"{{" {walk.rule(0, 0)} "}}"')

    def _key(self, name: str) -> str:
        return _lit(_compact(name) + ":")

    def _other_key(self, names: list[str]) -> str:
        """A key that is none of `names` (JSON objects here never repeat a key)."""
        any_key = f'"{_CHAR}*"'
        if not names:
            return self._terminal(any_key) + ' ":"'
        listed = "|".join(_escape_rx(_compact(n)) for n in names)
        return self._rule(f"{_rx(any_key)} & ~{_rx('(?:' + listed + ')')}", terminal=True) + ' ":"'

    # ---- any JSON value --------------------------------------------------------------------

    def any_value(self) -> str:
        if self._any is None:
            name = self._any = f"{self.prefix}any"
            string = self._terminal(f'"{_CHAR}*"')
            number = self._terminal(num.significant())
            member = f'{string} ":" {name}'
            self.rules += [
                f"{name}: {self.prefix}any_obj | {self.prefix}any_arr | {string} | {number}"
                ' | "true" | "false" | "null"',
                f'{self.prefix}any_obj: "{{" ({member} ("," {member})*)? "}}"',
                f'{self.prefix}any_arr: "[" ({name} ("," {name})*)? "]"',
            ]
        return self._any


class _ObjectWalk:
    """The object's body as rules over (next listed property, properties written so far):
    listed properties in order (each required or optional), then other keys if allowed,
    with the count kept where min/maxProperties need it (and 0 or not, for the commas)."""

    def __init__(self, lark: JsonLark, entries, extra, low: int, high: int | None):
        self.lark, self.entries, self.extra = lark, entries, extra
        self.low, self.high = low, high
        self.cap = high if high is not None else max(low, 1)  # counts past this are alike
        self.names: dict[tuple[int, int], str] = {}
        self.required_left = [0] * (len(entries) + 1)
        for i in range(len(entries) - 1, -1, -1):
            self.required_left[i] = self.required_left[i + 1] + entries[i][2]

    def feasible(self, i: int, count: int) -> bool:
        """Can the object still end within minProperties..maxProperties from here?"""
        if self.high is not None and count + self.required_left[i] > self.high:
            return False
        if self.extra is not None:
            return True
        return count + len(self.entries) - i >= self.low

    def rule(self, i: int, count: int) -> str:
        key = (i, count)
        if key not in self.names:
            name = self.names[key] = f"{self.lark.prefix}o{len(self.lark.rules)}_{i}_{count}"
            self.lark.rules.append("")  # reserved: a state may refer to itself
            at = len(self.lark.rules) - 1
            self.lark.rules[at] = f"{name}: {self._body(i, count)}"
        return self.names[key]

    def _step(self, i: int, count: int, key: str, value: str) -> str | None:
        after = min(count + 1, self.cap) if self.high is None else count + 1
        if not self.feasible(i, after):
            return None
        comma = '"," ' if count else ""
        return f"{comma}{key} {value} {self.rule(i, after)}"

    def _body(self, i: int, count: int) -> str:
        options: list[str | None] = []
        room = self.high is None or count < self.high
        if i < len(self.entries):
            key, value, required = self.entries[i]
            if room:
                options.append(self._step(i + 1, count, key, value))
            if not required and self.feasible(i + 1, count):
                options.append(self.rule(i + 1, count))
        else:
            if self.extra is not None and room:
                options.append(self._step(i, count, *self.extra))
            if count >= self.low:
                options.append('""')
        return " | ".join(o for o in options if o is not None)


def _bounds(node: dict) -> tuple[float | None, float | None, bool, bool]:
    """minimum, maximum and whether each is exclusive (2020-12 numbers or draft-4 flags)."""
    low, high = node.get("minimum"), node.get("maximum")
    ex_low, ex_high = node.get("exclusiveMinimum"), node.get("exclusiveMaximum")
    low_ex = high_ex = False
    if isinstance(ex_low, bool):
        low_ex = ex_low
    elif isinstance(ex_low, (int, float)):
        low, low_ex = (ex_low, True) if low is None or ex_low >= low else (low, False)
    if isinstance(ex_high, bool):
        high_ex = ex_high
    elif isinstance(ex_high, (int, float)):
        high, high_ex = (ex_high, True) if high is None or ex_high <= high else (high, False)
    return low, high, low_ex, high_ex


def _check_pattern_fits(node: dict, path: str) -> None:
    pattern, high = node.get("pattern"), node.get("maxLength")
    if isinstance(pattern, str) and isinstance(high, int):
        if pattern_min_width(pattern) > high:
            raise SchemaProblem(
                _at(path, "pattern"), f"every match of the pattern is longer than maxLength {high}"
            )


def _at(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _escape_rx(text: str) -> str:
    return "".join("\\" + c if c in "\\.+*?()|[]{}^$#&-~" else c for c in text)


def schema_lark(schema: Any) -> str:
    """A whole grammar: `start` is one JSON value matching `schema`."""
    lark = JsonLark()
    start = lark.schema(schema)
    return "\n".join([f"start: {start}", *lark.rules]) + "\n"
