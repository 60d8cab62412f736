"""A client's JSON Schema (`response_format`, a tool's `parameters`, Anthropic's and Ollama's
formats) checked before it is compiled into a grammar: its size, its nesting depth, its
meta-schema (never fetched) and nothing we cannot enforce exactly (structured.py). Each
refusal names the keyword's own path (`response_format.json_schema.schema.properties.zip.pattern`).
A schema that passed recently passes again unchecked: agents send the same tool schemas every turn.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from typing import Any

import jsonschema_rs

from ultrafast.server.errors import invalid_value, too_large
from ultrafast.server.json_body import MAX_DEPTH, nesting_ok
from ultrafast.server.protocol_models import Limits
from ultrafast.server.structured import check_schema_param


def check_client_schema(schema: Any, param: str, limits: Limits, keywords_param: str) -> None:
    """A client schema: its size (400 at `param`), then its depth, its meta-schema and
    nothing we cannot enforce exactly (400 naming the exact path under `keywords_param`,
    e.g. `...schema.properties.zip.pattern`; never weakened). A schema that passed recently
    passes again without the checks: agents send the same tool schemas every turn."""
    try:
        encoded = json.dumps(schema, ensure_ascii=False, separators=(",", ":")).encode(
            "utf-8", "surrogatepass"
        )
    except RecursionError:
        raise invalid_value(
            _at(keywords_param, _too_deep_path(schema)),
            f"the schema is nested more than {MAX_DEPTH} deep",
        ) from None
    size = len(encoded)
    if size > limits.max_schema_bytes:
        raise too_large(
            "grammar_too_large",
            param,
            f"the schema is {size} bytes; the limit is {limits.max_schema_bytes}",
        )
    if not isinstance(schema, dict):
        raise invalid_value(param, "a JSON Schema must be an object")
    digest = hashlib.sha256(encoded).digest()
    if _PASSED_SCHEMAS.seen(digest):
        return
    # the meta-validator (native code) recurses with the schema: an HTTP body is capped at
    # json_body.MAX_DEPTH already, and so is a schema from anywhere else
    if not nesting_ok(encoded):
        raise invalid_value(
            _at(keywords_param, _too_deep_path(schema)),
            f"the schema is nested more than {MAX_DEPTH} deep",
        )
    _check_meta_schema(schema, keywords_param)
    check_schema_param(schema, keywords_param)
    _PASSED_SCHEMAS.add(digest)


def _check_meta_schema(schema: dict, param: str) -> None:
    if not isinstance(schema.get("$schema", ""), str):
        raise invalid_value(
            _at(param, ["$schema"]), "not a valid JSON Schema: $schema must be a string"
        )
    if "$schema" in schema and schema["$schema"] not in KNOWN_METASCHEMAS:
        # an unknown draft is checked as 2020-12 (as jsonschema's validator_for did): never
        # fetched, which the meta-validator would otherwise try
        schema = {k: v for k, v in schema.items() if k != "$schema"}
    try:
        jsonschema_rs.meta.validate(schema)
    except jsonschema_rs.ValidationError as exc:
        where = ".".join(str(p) for p in exc.instance_path)
        message = str(exc).strip().splitlines()[0][:200]
        # `param` names the keyword itself (…schema.properties.zip.pattern), as OpenAI does
        raise invalid_value(
            _at(param, list(exc.instance_path)),
            f"not a valid JSON Schema{f' at {where}' if where else ''}: {message}",
        ) from None
    except jsonschema_rs.ReferencingError:  # nothing left to resolve; kept as a 400, not a 500
        raise invalid_value(param, "not a valid JSON Schema: unresolvable $schema") from None


def _at(param: str, path: list) -> str:
    """`param` followed by a JSON path: `.key` for object members, `[i]` for array items."""
    return param + "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in path)


def _too_deep_path(value: Any, max_depth: int = MAX_DEPTH) -> list:
    """The path to the first container nested deeper than `max_depth` (the schema is in
    memory already; walked without recursion, so any depth is safe)."""
    stack: list[tuple[Any, list]] = [(value, [])]
    while stack:
        node, path = stack.pop()
        if len(path) >= max_depth:
            return path
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, child in items:
            if isinstance(child, (dict, list)):
                stack.append((child, [*path, key]))
    return []


class _RecentDigests:
    """A bounded LRU set of digests (thread-safe enough: the event loop's thread only)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._seen: OrderedDict[bytes, None] = OrderedDict()

    def seen(self, digest: bytes) -> bool:
        if digest in self._seen:
            self._seen.move_to_end(digest)
            return True
        return False

    def add(self, digest: bytes) -> None:
        self._seen[digest] = None
        while len(self._seen) > self.capacity:
            self._seen.popitem(last=False)


_PASSED_SCHEMAS = _RecentDigests(1024)  # schemas that passed check_client_schema, by JSON


# the drafts whose meta-schemas jsonschema-rs carries (with and without the empty fragment)
KNOWN_METASCHEMAS = frozenset(
    uri + tail
    for uri in (
        "http://json-schema.org/draft-04/schema",
        "http://json-schema.org/draft-06/schema",
        "http://json-schema.org/draft-07/schema",
        "https://json-schema.org/draft/2019-09/schema",
        "https://json-schema.org/draft/2020-12/schema",
    )
    for tail in ("", "#")
)
