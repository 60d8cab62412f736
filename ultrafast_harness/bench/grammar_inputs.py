"""The grammar bench's inputs, shared by its in-process half (grammar.py) and its served half
(grammar_served.py): a ~10 KB schema new to the compile cache, and an agent-sized prompt."""

from __future__ import annotations

import json
import time


def big_schema(salt: int, target_bytes: int = 10_000) -> dict:
    """A ~10 KB object schema; `salt` makes each one new to the compile cache."""
    props: dict = {}
    i = 0
    while len(json.dumps(props)) < target_bytes - 200:
        props[f"field_{salt}_{i}"] = [
            {"type": "string", "maxLength": 20},
            {"type": "integer", "minimum": 0, "maximum": 10_000},
            {"enum": ["alpha", "beta", "gamma", "delta"]},
            {"type": "array", "items": {"type": "boolean"}, "maxItems": 4},
        ][i % 4]
        i += 1
    return {"type": "object", "properties": props, "required": list(props)[:4]}


def long_prompt() -> str:
    """An agent-sized prompt (a few hundred tokens), new to the prefix cache each call."""
    return f"Log {time.monotonic_ns()}:\n" + "GET /health returned 200 in 3 ms.\n" * 40
