"""Refuse, with the keyword's path, what a client JSON schema asks that we cannot enforce.

Runs before compiling, in time linear in the schema's size (which the protocol caps), so a
bad schema costs one walk: unsupported keywords and formats, remote or dangling `$ref`s,
`$ref` cycles no finite value can satisfy, huge enums, deep nesting, and regex patterns whose
size or repetition counts would make the lexer slow. What passes still compiles under
llguidance's own work limits (grammar/cache.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

# JSON Schema keywords llguidance does not implement (it would fail on them; refusing here
# names the path). Annotations (title, description, examples, ...) are accepted and ignored.
UNSUPPORTED_KEYWORDS = frozenset(
    {
        "not",
        "if",
        "then",
        "else",
        "dependentRequired",
        "dependentSchemas",
        "dependencies",
        "propertyNames",
        "unevaluatedProperties",
        "unevaluatedItems",
        "contains",
        "minContains",
        "maxContains",
        "uniqueItems",
        "$dynamicRef",
        "$dynamicAnchor",
        "$recursiveRef",
        "$recursiveAnchor",
    }
)
SUPPORTED_FORMATS = frozenset(
    {"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uuid", "uri"}
)
MAX_DEPTH = 32  # nested subschemas
MAX_ENUM_VALUES = 1024
MAX_ENUM_BYTES = 16 * 1024
MAX_PATTERN_CHARS = 1000
MAX_REPEAT = 1000  # the largest {n,m} bound in a pattern
_REPEAT = re.compile(r"\{(\d+)(?:,(\d*))?\}")

_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = ("additionalProperties", "additionalItems", "items")


@dataclass
class SchemaProblem(ValueError):
    """`path`: the keyword's path inside the schema ("properties.x.pattern", "" = root)."""

    path: str
    message: str
    code: str = "invalid_schema"  # "unsupported_schema" for what is valid but not enforced

    def __str__(self) -> str:
        return self.message

    def param(self, prefix: str) -> str:
        """The request's param: `prefix` then the path (an item index `[1]...` is joined
        without a dot)."""
        if not self.path:
            return prefix
        return f"{prefix}{self.path}" if self.path.startswith("[") else f"{prefix}.{self.path}"


def _join(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def check_schema(schema: object) -> None:
    """SchemaProblem for the first thing we cannot enforce."""
    if not isinstance(schema, (dict, bool)):
        raise SchemaProblem("", "a JSON Schema must be an object or a boolean")
    refs: list[tuple[str, str]] = []  # (path of the $ref, its target)
    _walk(schema, "", 0, refs)
    for path, target in refs:
        if _resolve(schema, target) is None:
            raise SchemaProblem(_join(path, "$ref"), f"$ref {target!r} points nowhere")
    _check_ref_cycles(schema, refs)


def _walk(node: object, path: str, depth: int, refs: list[tuple[str, str]]) -> None:
    if isinstance(node, bool):
        return
    if not isinstance(node, dict):
        raise SchemaProblem(path, "a subschema must be an object or a boolean")
    if depth > MAX_DEPTH:
        raise SchemaProblem(path, f"the schema nests deeper than {MAX_DEPTH} levels")
    for key in node:
        if key in UNSUPPORTED_KEYWORDS:
            raise SchemaProblem(
                _join(path, key),
                f"the keyword {key!r} cannot be enforced while decoding",
                "unsupported_schema",
            )
    fmt = node.get("format")
    if fmt is not None and fmt not in SUPPORTED_FORMATS:
        raise SchemaProblem(
            _join(path, "format"),
            f"format {fmt!r} is not supported (supported: {', '.join(sorted(SUPPORTED_FORMATS))})",
            "unsupported_schema",
        )
    if "pattern" in node:
        _check_pattern(node["pattern"], _join(path, "pattern"))
    if "enum" in node:
        _check_enum(node["enum"], _join(path, "enum"))
    ref = node.get("$ref")
    if ref is not None:
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise SchemaProblem(
                _join(path, "$ref"), "only local $refs (#/...) are supported", "unsupported_schema"
            )
        refs.append((path, ref))
    for key in _SCHEMA_MAPS:
        children = node.get(key)
        if isinstance(children, dict):
            for name, child in children.items():
                if key == "patternProperties":
                    _check_pattern(name, _join(_join(path, key), name))
                _walk(child, _join(_join(path, key), name), depth + 1, refs)
    for key in _SCHEMA_LISTS:
        children = node.get(key)
        if isinstance(children, list):
            for i, child in enumerate(children):
                _walk(child, _join(_join(path, key), i), depth + 1, refs)
    for key in _SCHEMA_ONE:
        child = node.get(key)
        if isinstance(child, list):  # draft-04 tuple `items`
            for i, item in enumerate(child):
                _walk(item, _join(_join(path, key), i), depth + 1, refs)
        elif child is not None:
            _walk(child, _join(path, key), depth + 1, refs)


def _check_pattern(pattern: object, path: str) -> None:
    if not isinstance(pattern, str):
        raise SchemaProblem(path, "a pattern must be a string")
    if len(pattern) > MAX_PATTERN_CHARS:
        raise SchemaProblem(path, f"the pattern is longer than {MAX_PATTERN_CHARS} characters")
    try:  # the "regex" format of the meta-schema, which its validator does not check
        re.compile(pattern)
    except re.error as exc:
        raise SchemaProblem(path, f"the pattern is not a valid regular expression: {exc}") from None
    for low, high in _REPEAT.findall(pattern):
        if int(low) > MAX_REPEAT or (high and int(high) > MAX_REPEAT):
            raise SchemaProblem(
                path, f"the pattern repeats more than {MAX_REPEAT} times in one bound"
            )


def _check_enum(values: object, path: str) -> None:
    if not isinstance(values, list):
        raise SchemaProblem(path, "enum must be an array")
    if len(values) > MAX_ENUM_VALUES:
        raise SchemaProblem(path, f"enum has {len(values)} values; the limit is {MAX_ENUM_VALUES}")
    size = len(json.dumps(values, ensure_ascii=False))
    if size > MAX_ENUM_BYTES:
        raise SchemaProblem(path, f"enum is {size} bytes; the limit is {MAX_ENUM_BYTES}")


def _resolve(schema: object, ref: str) -> object | None:
    """The subschema a local `#/a/b` pointer names (RFC 6901 escapes), or None."""
    node = schema
    if ref in ("#", "#/"):
        return node
    if not ref.startswith("#/"):
        return None
    for raw in ref[2:].split("/"):
        part = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _mandatory_refs(node: object) -> list[str]:
    """The $refs every value matching `node` must also match (through allOf, single-branch
    anyOf/oneOf, required properties and non-empty arrays), not crossing other $refs."""
    out: list[str] = []
    stack = [node]
    while stack:
        cur = stack.pop()
        if not isinstance(cur, dict):
            continue
        if isinstance(cur.get("$ref"), str):
            out.append(cur["$ref"])
        if isinstance(cur.get("allOf"), list):
            stack.extend(cur["allOf"])
        for key in ("anyOf", "oneOf"):
            branches = cur.get(key)
            if isinstance(branches, list) and len(branches) == 1:
                stack.append(branches[0])
        props, required = cur.get("properties"), cur.get("required")
        if isinstance(props, dict) and isinstance(required, list):
            stack.extend(props[k] for k in required if isinstance(k, str) and k in props)
        min_items = cur.get("minItems", 0)
        if isinstance(min_items, int) and min_items > 0:
            prefix = cur.get("prefixItems")
            if isinstance(prefix, list):
                stack.extend(prefix[:min_items])
            if isinstance(cur.get("items"), dict):
                stack.append(cur["items"])
    return out


def _check_ref_cycles(schema: object, refs: list[tuple[str, str]]) -> None:
    """A $ref that must contain itself has no finite instance: refuse it."""
    targets = {"#"} | {target for _, target in refs}
    graph = {t: _mandatory_refs(_resolve(schema, t)) for t in targets}
    where = {target: path for path, target in reversed(refs)}  # first $ref to each target
    for start in graph:
        seen: set[str] = set()
        stack = list(graph[start])
        while stack:
            target = stack.pop()
            if target == start:
                raise SchemaProblem(
                    _join(where.get(start, ""), "$ref"),
                    f"$ref cycle: {start!r} requires itself, so no finite value matches",
                )
            if target not in seen:
                seen.add(target)
                stack.extend(graph.get(target, ()))
