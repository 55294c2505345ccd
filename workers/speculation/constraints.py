"""A request's constraint as plain data: what it is (`parse_constraint`) and how it can be refused.

Nothing here imports the grammar engine: the gateway parses and checks a constraint before any
compile, in processes (a Ray ingress) that must not load torch, which xgrammar imports.

The refusals a client may read are written here, never copied from the engine: xgrammar's
messages carry its build paths, source lines and timestamps (`[03:09:08] /project/cpp/…cc:5082:
Unsupported type "x"`). `engine_refusal` keeps the engine's words for the log and gives the client
a short message of ours, naming what is wrong where the engine's message says so.
"""
from __future__ import annotations

import json
import re
from typing import Any

__all__ = ["ConstraintError", "SchemaTooComplex", "CompileTimeout", "CompilerBusy", "GENERIC_REFUSAL",
           "engine_refusal", "parse_constraint"]


class ConstraintError(ValueError):
    """A constraint that cannot be served. Its message is the client's to read; `detail` (the
    engine's own words, when it refused) is for the server's log only."""

    def __init__(self, message: str, detail: str | None = None) -> None:
        super().__init__(message)
        self.detail = detail


class SchemaTooComplex(ConstraintError):
    """A schema over one of the caps that bound a compile's work (`cap`: the cap's name)."""

    def __init__(self, message: str, cap: str) -> None:
        super().__init__(message)
        self.cap = cap


class CompileTimeout(SchemaTooComplex):
    """A compile that ran past its time limit: ended (its process killed), nothing kept."""

    def __init__(self, limit_s: float) -> None:
        super().__init__(f"the schema takes longer than {limit_s:g} s to compile "
                         f"(grammar_compile_timeout_s); simplify it", "grammar_compile_timeout_s")
        self.limit_s = limit_s


class CompilerBusy(RuntimeError):
    """No compile process came free in time: the server's condition, not the schema's."""

    def __init__(self, retry_after_s: float) -> None:
        super().__init__("every grammar compiler is busy")
        self.retry_after_s = retry_after_s


def parse_constraint(constraint: str) -> tuple[str, dict[str, Any]]:
    """("json_object", {"type": "object"}) or ("json_schema", schema) for a constraint string.

    >>> parse_constraint('{"type": "json_object"}')
    ('json_object', {'type': 'object'})
    """
    try:
        spec = json.loads(constraint)
    except (ValueError, RecursionError):
        raise ConstraintError("the constraint is not valid JSON") from None
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind == "json_object":
        return kind, {"type": "object"}
    if kind == "json_schema":
        schema = spec.get("schema")
        if not isinstance(schema, dict):
            raise ConstraintError("a json_schema constraint needs a 'schema' object")
        return kind, schema
    raise ConstraintError(f"unsupported constraint type {_quoted(kind)}: use json_object or json_schema")


# The engine's refusals we can name, by the words that carry their meaning; anything else gets
# the generic message. Each pattern reads only the text after the engine's location prefix.
_KNOWN: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r'Unsupported type "([^"]{0,64})"'), 'unsupported type "{0}"'),
    (re.compile(r"Regex parsing error at position (\d+)"),
     "a pattern is not a regular expression the engine supports (at character {0})"),
    (re.compile(r"Cannot find field '([^']{0,64})'"), "a $ref points to nothing ('{0}' is not there)"),
    (re.compile(r"[Uu]nsupported (?:keyword|format)[^A-Za-z0-9]*([A-Za-z0-9_$-]{1,64})"),
     "unsupported keyword or format '{0}'"),
)
_PREFIX = re.compile(r"^\s*\[[0-9:]+\]\s*\S+:\d+:\s*")      # "[03:09:08] /project/cpp/x.cc:5082: "
GENERIC_REFUSAL = "the schema uses something the grammar engine cannot enforce"


def engine_refusal(detail: str) -> ConstraintError:
    """The client's error for a compile the engine refused with `detail` (kept for the log).

    >>> str(engine_refusal('[03:09:08] /project/cpp/json_schema_converter.cc:5082: Unsupported type "no-such"'))
    'the schema cannot be used: unsupported type "no-such"'
    >>> str(engine_refusal("std::bad_alloc"))
    'the schema cannot be used: the schema uses something the grammar engine cannot enforce'
    """
    text = _PREFIX.sub("", detail.strip().splitlines()[0] if detail.strip() else "")
    reason = GENERIC_REFUSAL
    for pattern, message in _KNOWN:
        m = pattern.search(text)
        if m:
            reason = message.format(*m.groups())
            break
    return ConstraintError(f"the schema cannot be used: {reason}", detail=detail)


def _quoted(value: Any) -> str:
    """A client's value in a message, bounded: they see their own input, never much of it."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
