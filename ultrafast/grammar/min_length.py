"""The shortest JSON text a schema allows, in characters, and the keyword that makes it long.

A schema whose shortest answer cannot fit in the request's token budget (a `pattern` like
`^(a{999}){999}$`, a `minLength` or `minItems` in the millions) would generate until
max_tokens and end as invalid JSON; the server answers 400 naming that keyword instead
(server/calls.py), before generating. A lower bound: `$ref`s and formats count as one
character, so it never refuses a schema that could fit.
"""

from __future__ import annotations

import importlib
import json
import math
import re
import sys
from typing import Any

# Python's own regex parser (its module was renamed in 3.11)
_sre: Any = importlib.import_module("re._parser" if sys.version_info >= (3, 11) else "sre_parse")


Leaf = tuple[float, str]  # (its characters, its path)
_SCALAR = {"boolean": 4, "null": 4, "integer": 1, "number": 1}


def pattern_min_width(pattern: str) -> float:
    """The fewest characters a match of `pattern` has (unanchored patterns included)."""
    try:
        low = _sre.parse(pattern).getwidth()[0]
    except (re.error, RecursionError, OverflowError):
        return 0
    return math.inf if low >= _sre.MAXREPEAT else low


def min_chars(schema: Any, path: str = "") -> tuple[float, Leaf]:
    """(the shortest answer's characters, the largest single keyword's share and path)."""
    if schema is False:
        return math.inf, (math.inf, path)
    if not isinstance(schema, dict):
        return 1, (0, path)
    if "const" in schema:
        return len(_compact(schema["const"])), (0, path)
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return min(len(_compact(v)) for v in schema["enum"]), (0, path)
    for key, pick in (("anyOf", min), ("oneOf", min), ("allOf", max)):
        branches = schema.get(key)
        if isinstance(branches, list) and branches:
            found = [min_chars(b, f"{_at(path, key)}[{i}]") for i, b in enumerate(branches)]
            return pick(found, key=lambda f: f[0])
    kind = schema.get("type")
    if isinstance(kind, list):
        return min((min_chars({**schema, "type": k}, path) for k in kind), key=lambda f: f[0])
    if not isinstance(kind, str):
        kind = "object" if "properties" in schema else ""
    if kind == "string":
        return _string(schema, path)
    if kind == "array":
        return _array(schema, path)
    if kind == "object":
        return _object(schema, path)
    return _SCALAR.get(kind, 1), (0, path)


def _string(schema: dict, path: str) -> tuple[float, Leaf]:
    leaf: Leaf = (0, path)
    low = schema.get("minLength", 0)
    if isinstance(low, int) and low > 0:
        leaf = (low, _at(path, "minLength"))
    pattern = schema.get("pattern")
    if isinstance(pattern, str):
        width = pattern_min_width(pattern)
        if width > leaf[0]:
            leaf = (width, _at(path, "pattern"))
    return 2 + leaf[0], leaf


def _array(schema: dict, path: str) -> tuple[float, Leaf]:
    count = schema.get("minItems", 0)
    if not isinstance(count, int) or count <= 0:
        return 2, (0, path)
    item, leaf = min_chars(schema.get("items", True), _at(path, "items"))
    total = 2 + count * item + count - 1
    if total > leaf[0] and count > 1:
        leaf = (total, _at(path, "minItems"))
    return total, leaf


def _object(schema: dict, path: str) -> tuple[float, Leaf]:
    props = schema.get("properties")
    props = props if isinstance(props, dict) else {}
    required = schema.get("required")
    required = required if isinstance(required, list) else []
    total, best = 2.0, (0.0, path)
    for name in dict.fromkeys(k for k in required if isinstance(k, str)):
        value, leaf = min_chars(props.get(name, True), _at(_at(path, "properties"), name))
        total += len(_compact(name)) + 1 + value + (total > 2)
        best = max(best, leaf, key=lambda f: f[0])
    return total, best


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _at(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key
