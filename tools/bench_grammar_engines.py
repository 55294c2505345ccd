"""`specgate bench grammar-engines`: per-token cost of the grammar engines specgate could use
(xgrammar, llguidance) on the default model's tokenizer: what picked workers/speculation/grammar.py's engine.

For a few JSON schemas, a valid instance is tokenized and replayed through each engine's matcher
as decoding would: per token, fill the next-token bitmask, then accept the token. Speculation adds
a rollback per rejected draft node and a walk of the tree (accept, recurse, roll back), so one
rollback per token is timed too. Reported per engine and schema: compile time (once per schema,
cached after) and the mean microseconds per token of fill, accept and rollback. Both engines are
optional imports: an engine that is not installed is reported as missing.
"""
from __future__ import annotations

import argparse
import json
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

from loadtest.results import write_result

# (name, schema, an instance that validates): a flat record, nested objects with arrays, enums
# and numbers, and a string pattern; what the structured-output benchmark's schemas look like.
SCHEMAS: list[tuple[str, dict, Any]] = [
    ("person", {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                                  "email": {"type": "string"}},
                "required": ["name", "age", "email"], "additionalProperties": False},
     {"name": "Ada Lovelace", "age": 36, "email": "ada@example.com"}),
    ("order", {"type": "object", "properties": {
        "id": {"type": "integer"},
        "status": {"enum": ["pending", "shipped", "delivered", "cancelled"]},
        "items": {"type": "array", "items": {"type": "object", "properties": {
            "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1},
            "price": {"type": "number"}}, "required": ["sku", "qty", "price"], "additionalProperties": False}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"], "additionalProperties": False}},
        "required": ["id", "status", "items", "address"], "additionalProperties": False},
     {"id": 1042, "status": "shipped", "items": [{"sku": "A-1", "qty": 2, "price": 9.5},
                                                 {"sku": "B-22", "qty": 1, "price": 120.0}],
      "address": {"city": "Lyon", "zip": "69001"}}),
    ("pattern", {"type": "object", "properties": {
        "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4}},
        "required": ["date", "code", "tags"], "additionalProperties": False},
     {"date": "2024-03-15", "code": "ABC-123", "tags": ["red", "blue"]}),
    ("json_object", {"type": "object"},
     {"title": "A long walk", "pages": 312, "authors": ["N. M.", "J. K."], "in_print": True}),
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model whose tokenizer to use (default: the default model)")
    p.add_argument("--repeats", type=int, default=20, help="replays of each instance per engine")
    p.add_argument("--json", type=Path, help="write the report here")


def run(args: argparse.Namespace) -> int:
    report = bench_grammar_engines(model=args.model, repeats=args.repeats)
    text = json.dumps(report, indent=1)
    if args.json:
        write_result(args.json, report)
    print(text)
    return 0


def _xgrammar(tokenizer, vocab: int):
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)

    def compile_(schema: dict):
        strict = schema != {"type": "object"}
        return compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"),
                                            strict_mode=strict)

    def matcher(compiled):
        return xgr.GrammarMatcher(compiled)

    mask = xgr.allocate_token_bitmask(1, vocab)
    ops = {"fill": lambda m: m.fill_next_token_bitmask(mask, 0),
           "accept": lambda m, t: m.accept_token(t),
           "rollback": lambda m: m.rollback(1)}
    return version("xgrammar"), compile_, matcher, ops


def _llguidance(tokenizer, vocab: int):
    import llguidance
    import llguidance.hf
    import llguidance.torch

    tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)

    def compile_(schema: dict):
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults={"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"})
        return grammar

    def matcher(grammar):
        return llguidance.LLMatcher(tok, grammar)

    mask = llguidance.torch.allocate_token_bitmask(1, tok.vocab_size)
    ops = {"fill": lambda m: llguidance.torch.fill_next_token_bitmask(m, mask, 0),
           "accept": lambda m, t: m.consume_token(t),
           "rollback": lambda m: m.rollback(1)}
    return version("llguidance"), compile_, matcher, ops


def _replay(matcher, ops, ids: list[int], repeats: int) -> dict[str, float]:
    """Mean µs per token of fill, accept and (accept again after a) rollback over `repeats` replays."""
    fill = accept = rollback = 0.0
    for _ in range(repeats):
        m = matcher()
        for t in ids:
            t0 = time.perf_counter()
            ops["fill"](m)
            t1 = time.perf_counter()
            if ops["accept"](m, t) is False:
                raise RuntimeError(f"engine refused token {t} of a valid instance")
            t2 = time.perf_counter()
            ops["rollback"](m)
            t3 = time.perf_counter()
            ops["accept"](m, t)
            fill, accept, rollback = fill + t1 - t0, accept + t2 - t1, rollback + t3 - t2
    n = repeats * len(ids)
    return {"fill_us": round(1e6 * fill / n, 2), "accept_us": round(1e6 * accept / n, 2),
            "rollback_us": round(1e6 * rollback / n, 2),
            "per_token_us": round(1e6 * (fill + accept + rollback) / n, 2)}


def bench_grammar_engines(*, model: str | None = None, repeats: int = 20) -> dict[str, Any]:
    from workers.model.loader import DEFAULT_MODEL, load_tokenizer, resolve_model

    path = resolve_model(model or DEFAULT_MODEL, progress=False)
    tokenizer = load_tokenizer(str(path), progress=False)
    vocab = len(tokenizer)
    out: dict[str, Any] = {"settings": {"model": model or DEFAULT_MODEL, "vocab": vocab, "repeats": repeats},
                           "engines": {}}
    for name, make in (("xgrammar", _xgrammar), ("llguidance", _llguidance)):
        try:
            version, compile_, matcher, ops = make(tokenizer, vocab)
        except ImportError as e:
            out["engines"][name] = {"missing": str(e)}
            continue
        rows = {}
        for sname, schema, instance in SCHEMAS:
            text = json.dumps(instance, separators=(",", ":"))
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            t0 = time.perf_counter()
            compiled = compile_(schema)
            compile_ms = 1e3 * (time.perf_counter() - t0)
            rows[sname] = {"tokens": len(ids), "compile_ms": round(compile_ms, 1),
                           **_replay(lambda: matcher(compiled), ops, ids, repeats)}
        per_token = [r["per_token_us"] for r in rows.values()]
        out["engines"][name] = {"version": version, "schemas": rows,
                                "mean_per_token_us": round(sum(per_token) / len(per_token), 2)}
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
