"""Caps on a JSON schema's size and shape, checked on the parsed schema before any compile.

A grammar's compile time and size grow with what the schema asks the engine to unroll: every
property is rules of its own, every enum value a branch, and a pattern's bounded repeat `{m,n}`
n copies of what it repeats, multiplied by every place the pattern appears. A schema is small
to send and large to compile, so the cheap check comes first: `inspect` walks the parsed schema
once (pure; no engine) and `SchemaCaps.check` refuses the first cap it is over, naming it. What
the caps let through is still bounded by the compile's time limit (workers/speculation/compile_pool.py).

The same walk gives the schema's canonical form, the key compiles are shared by: the schema
without the keywords that only annotate (`description`, `title`, `$comment`, `examples`), which
change no grammar, so schemas that differ only in their descriptions compile once.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from workers.speculation.constraints import SchemaTooComplex, parse_constraint

__all__ = ["SchemaCaps", "Shape", "inspect", "canonical_key"]

ANNOTATIONS = frozenset({"description", "title", "$comment", "examples"})
# keywords whose value is one subschema, a list of them, or a map of name -> subschema
_ONE = ("items", "additionalProperties", "additionalItems", "contains", "not", "if", "then", "else",
        "propertyNames", "unevaluatedItems", "unevaluatedProperties")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_BOUNDS = ("minItems", "maxItems", "minContains", "maxContains")
# a quantifier's counts: {m}, {m,}, {m,n}, {,n}; not one written as a literal (\{)
_REPEAT = re.compile(r"(?<!\\)\{(\d*),?(\d*)\}")
DEEPEST = 64          # the walk stops descending here: no cap may be set deeper (gateway/settings.py)


@dataclass
class Shape:
    """What the caps measure of one schema (root depth 1; counts over the whole schema)."""
    depth: int = 0
    properties: int = 0
    enum_values: int = 0
    enum_chars: int = 0
    pattern_chars: int = 0        # the longest pattern (or patternProperties key)
    repeat: int = 0               # the largest count in a pattern's {m,n}
    items: int = 0                # the largest minItems / maxItems (minContains, maxContains)


@dataclass(frozen=True)
class SchemaCaps:
    """The most a schema may ask of the compiler. Defaults admit real tool and response schemas:
    OpenAI's published limits for structured outputs are 10 levels of nesting, 5,000 properties,
    1,000 enum values and 15,000 characters of a large enum's values; ours are lower where a
    2-core CPU compiles the grammar (properties) and count every subschema as a level
    (`items`, `anyOf`), so 20 levels admit OpenAI's 10 levels of objects."""
    max_bytes: int = 131_072
    max_depth: int = 20
    max_properties: int = 1_000
    max_enum_values: int = 1_000
    max_enum_chars: int = 15_000
    max_pattern_chars: int = 1_000
    max_repeat: int = 100
    max_items: int = 1_000

    def check(self, constraint: str) -> str:
        """The canonical key of a constraint (`inspect`) if it is within every cap; else
        SchemaTooComplex naming the first cap it is over (ConstraintError if it is no constraint)."""
        size = len(constraint.encode("utf-8", "surrogatepass"))
        if size > self.max_bytes:
            raise _over("the schema is {} bytes long", size, self.max_bytes, "schema_max_bytes")
        kind, schema = parse_constraint(constraint)
        shape, _, key = inspect(kind, schema)
        for phrase, found, cap, name in (
                ("the schema nests {} levels deep", shape.depth, self.max_depth, "schema_max_depth"),
                ("the schema has {} properties", shape.properties, self.max_properties,
                 "schema_max_properties"),
                ("the schema has {} enum and const values", shape.enum_values, self.max_enum_values,
                 "schema_max_enum_values"),
                ("the schema's enum and const values have {} characters", shape.enum_chars,
                 self.max_enum_chars, "schema_max_enum_chars"),
                ("a pattern has {} characters", shape.pattern_chars, self.max_pattern_chars,
                 "schema_max_pattern_chars"),
                ("a pattern repeats something {} times ({{m,n}})", shape.repeat, self.max_repeat,
                 "schema_max_repeat"),
                ("an array bound (minItems, maxItems) is {}", shape.items, self.max_items,
                 "schema_max_items")):
            if found > cap:
                raise _over(phrase, found, cap, name)
        return key


def _over(phrase: str, found: int, cap: int, name: str) -> SchemaTooComplex:
    return SchemaTooComplex(f"{phrase.format(f'{found:,}')}; the most allowed is {cap:,} ({name})", name)


def inspect(kind: str, schema: dict[str, Any]) -> tuple[Shape, dict[str, Any], str]:
    """(its shape, the schema without annotations, its canonical key) for a parsed constraint:
    one walk of the schema.

    >>> shape, _, key = inspect("json_schema", {"type": "object", "description": "d",
    ...     "properties": {"title": {"type": "string", "title": "t", "pattern": "^a{2,30}$"}}})
    >>> (shape.depth, shape.properties, shape.repeat, key)
    (2, 1, 30, 'json_schema:{"type":"object","properties":{"title":{"type":"string","pattern":"^a{2,30}$"}}}')
    """
    shape = Shape()
    clean = _walk(schema, 1, shape)
    return shape, clean, f"{kind}:{json.dumps(clean, separators=(',', ':'), ensure_ascii=False)}"


def canonical_key(constraint: str) -> tuple[str, dict[str, Any], str]:
    """(kind, the schema the engine compiles, the key compiles are shared by) for a constraint
    string; ConstraintError if it is none."""
    kind, schema = parse_constraint(constraint)
    _, clean, key = inspect(kind, schema)
    return kind, clean, key


def _walk(node: Any, depth: int, shape: Shape) -> Any:
    """The node without its annotations, its subschemas walked; `shape` gathers the counts."""
    if not isinstance(node, dict):
        return node                               # true / false, or what the engine will refuse
    shape.depth = max(shape.depth, depth)
    if depth > DEEPEST:
        return {}
    _count(node, shape)
    out: dict[str, Any] = {}
    for k, v in node.items():
        if k in ANNOTATIONS:
            continue
        if k in _ONE:
            v = [_walk(s, depth + 1, shape) for s in v] if isinstance(v, list) else _walk(v, depth + 1, shape)
        elif k in _LIST and isinstance(v, list):
            v = [_walk(s, depth + 1, shape) for s in v]
        elif k in _MAP and isinstance(v, dict):
            if k == "properties":
                shape.properties += len(v)
            elif k == "patternProperties":
                for p in v:
                    _pattern(p, shape)
            v = {name: _walk(s, depth + 1, shape) for name, s in v.items()}
        out[k] = v
    return out


def _count(node: dict[str, Any], shape: Shape) -> None:
    enum = node.get("enum")
    if isinstance(enum, list):
        shape.enum_values += len(enum)
        shape.enum_chars += sum(_chars(v) for v in enum)
    if "const" in node:
        shape.enum_values += 1
        shape.enum_chars += _chars(node["const"])
    if isinstance(node.get("pattern"), str):
        _pattern(node["pattern"], shape)
    for bound in _BOUNDS:
        value = node.get(bound)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            shape.items = max(shape.items, int(min(value, 2**62)))


def _pattern(pattern: str, shape: Shape) -> None:
    shape.pattern_chars = max(shape.pattern_chars, len(pattern))
    for low, high in _REPEAT.findall(pattern):
        for n in (low, high):
            if n:
                shape.repeat = max(shape.repeat, int(n[:19]))


def _chars(value: Any) -> int:
    return len(value) if isinstance(value, str) else len(json.dumps(value))
