"""GrammarSpec: what a constrained request must follow, as an llguidance Lark grammar.

Pure Python (no llguidance import), so `request.py` and the server can build and hash specs
without the engine. JSON schemas become our own rules (json_lark.py), which may embed what
they leave to llguidance with `%json { ... }`.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field


@dataclass(frozen=True)
class GrammarSpec:
    """An llguidance Lark grammar plus where it came from ("json_object", "json_schema",
    "tools", ...). Frozen and hashable; `key` keys the compile cache."""

    lark: str
    source: str = "lark"
    # the shortest answer's characters, and the schema keyword (path) that makes it that long
    min_chars: float = field(default=0, compare=False)
    min_path: str = field(default="", compare=False)

    @functools.cached_property
    def key(self) -> str:
        """A stable hash of the grammar text (same grammar, same key, in any process)."""
        return hashlib.sha256(self.lark.encode()).hexdigest()[:32]

    def embedding(self) -> tuple[str, list[str]]:
        """The start rule's body and the other rules, for a grammar that embeds this one as
        one alternative (tool calls OR this answer); its rule names (`j_...`) are its own."""
        start, *rules = self.lark.strip().split("\n")
        head, _, body = start.partition("start:")
        if head:
            raise ValueError("the grammar does not begin with its start rule")
        return body.strip(), rules

    @staticmethod
    def json_lark(schema: dict | bool) -> str:
        """A Lark grammar whose start rule is one JSON value matching `schema`, in one
        compact spelling, with bounded numbers and counts (json_lark.py). SchemaProblem
        (with the keyword's path) when no value can match."""
        from ultrafast.grammar.json_lark import schema_lark

        return schema_lark(schema)

    @classmethod
    def from_json_schema(cls, schema: dict, strict: bool = False) -> GrammarSpec:
        """`response_format: json_schema`. The grammar enforces the schema in both modes:
        `strict` only changes what the API promises, never what we enforce (weaker would be
        a silent downgrade)."""
        from ultrafast.grammar.min_length import min_chars

        chars, (_, path) = min_chars(schema)
        return cls(cls.json_lark(schema), "json_schema", chars, path)

    @classmethod
    def json_object(cls) -> GrammarSpec:
        """`response_format: json_object`: any JSON object."""
        return cls(cls.json_lark({"type": "object"}), "json_object")
