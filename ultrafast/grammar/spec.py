"""GrammarSpec: what a constrained request must follow, as an llguidance Lark grammar.

Pure Python (no llguidance import), so `request.py` and the server can build and hash specs
without the engine. The Lark text may embed JSON schemas with `%json { ... }`.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass

# Compact separators are pinned: the grammar and the model agree on one JSON spelling
# (a schema without a whitespace choice would otherwise admit arbitrary indentation).
_JSON_OPTIONS = {"item_separator": ",", "key_separator": ":", "whitespace_flexible": False}


def _compact(value: object) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


@dataclass(frozen=True)
class GrammarSpec:
    """An llguidance Lark grammar plus where it came from ("json_object", "json_schema",
    "tools", ...). Frozen and hashable; `key` keys the compile cache."""

    lark: str
    source: str = "lark"

    @functools.cached_property
    def key(self) -> str:
        """A stable hash of the grammar text (same grammar, same key, in any process)."""
        return hashlib.sha256(self.lark.encode()).hexdigest()[:32]

    @staticmethod
    def json_lark(schema: dict | bool) -> str:
        """A Lark grammar whose start rule is one JSON value matching `schema`. Other specs
        (tool calls) embed schemas the same way."""
        if isinstance(schema, dict):
            schema = {**schema, "x-guidance": {**_JSON_OPTIONS, **schema.get("x-guidance", {})}}
        else:
            schema = {"x-guidance": _JSON_OPTIONS} if schema else {"not": {}}
        return f"start: %json {_compact(schema)}\n"

    @classmethod
    def from_json_schema(cls, schema: dict, strict: bool = False) -> GrammarSpec:
        """`response_format: json_schema`. The grammar enforces the schema in both modes:
        `strict` only changes what the API promises, never what we enforce (weaker would be
        a silent downgrade)."""
        return cls(cls.json_lark(schema), "json_schema")

    @classmethod
    def json_object(cls) -> GrammarSpec:
        """`response_format: json_object`: any JSON object."""
        return cls(cls.json_lark({"type": "object"}), "json_object")
