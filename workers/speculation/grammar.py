"""Structured outputs: a request's grammar (a JSON schema, or any JSON object) as a logit rule at
every tree row (workers/speculation/processors.py), on xgrammar.

Why xgrammar: of the two engines made for this (xgrammar, llguidance), it fills a next-token mask
over the default model's vocabulary in the least time per token, and it rolls back, which walking
a tree needs (tools/bench_grammar_engines.py, results/bench_grammar_engines.json).

A constraint is `SamplingParams.constraint`, a JSON string: ``{"type": "json_object"}`` (any
JSON object) or ``{"type": "json_schema", "schema": {...}}`` (strict: no property or item the
schema does not name). Output is compact JSON (no whitespace between tokens, separators "," and
":"): a small model let free to write whitespace can write it forever, and compact output has
more forced tokens for the grammar drafter (workers/drafters/grammar.py) to propose.

`Grammars` compiles each constraint once per process (a bounded LRU keyed by the constraint
string) for one tokenizer; the gateway compiles through the same object to refuse a bad schema
with a 400 before the request reaches the step loop. `GrammarRule` is one request's
`NodeProcessor`: its matcher sits after the committed output, and each tree row's state is that
matcher advanced along the row's own path (accept the path's tokens, then roll them back), so
every row is masked exactly as plain constrained decoding would mask that position. When the
grammar is complete only the stop tokens are allowed, so the request ends there.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any, Callable, Iterable, Sequence

import torch
import xgrammar as xgr

from workers.contract import SamplingParams
from workers.speculation.processors import NodeProcessor, ProcessorFactory, sampling_processors
from workers.speculation.tree import TokenTree, children, keep

__all__ = ["ConstraintError", "Grammars", "GrammarRule", "grammar_processors", "parse_constraint"]

# Compiled grammars kept per process; a schema's compiled form is a few hundred KB at most.
DEFAULT_CACHE_SIZE = 256
_SEPARATORS = (",", ":")


class ConstraintError(ValueError):
    """A constraint that is not one of the supported kinds, or a schema the engine cannot compile."""


def parse_constraint(constraint: str) -> tuple[str, dict[str, Any]]:
    """("json_object", {"type": "object"}) or ("json_schema", schema) for a constraint string.

    >>> parse_constraint('{"type": "json_object"}')
    ('json_object', {'type': 'object'})
    """
    try:
        spec = json.loads(constraint)
    except ValueError as e:
        raise ConstraintError(f"constraint is not JSON: {e}") from None
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind == "json_object":
        return kind, {"type": "object"}
    if kind == "json_schema":
        schema = spec.get("schema")
        if not isinstance(schema, dict):
            raise ConstraintError("a json_schema constraint needs a 'schema' object")
        return kind, schema
    raise ConstraintError(f"unsupported constraint type {kind!r}: use json_object or json_schema")


class Grammars:
    """The constraints of one tokenizer, compiled once each (bounded LRU, thread-safe: the
    gateway's threads compile to validate while the step loop compiles to admit).

    The engine's view of the tokenizer (`make_info()`) is built on the first compile, not here: a
    deployment that never sees a constraint never pays for it."""

    def __init__(self, make_info: Callable[[], xgr.TokenizerInfo], vocab: int, stop_token_ids: Iterable[int],
                 cache_size: int = DEFAULT_CACHE_SIZE):
        """`vocab`: the model's logits per row (the info's vocab_size must equal it)."""
        self.vocab = vocab
        self.stop_token_ids = sorted({int(t) for t in stop_token_ids})
        if not self.stop_token_ids:
            raise ValueError("a grammar needs at least one stop token to end the output with")
        self._make_info = make_info
        self._compiler: xgr.GrammarCompiler | None = None
        self._token_ids: dict[bytes, int] | None = None
        self._cache: OrderedDict[str, xgr.CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, vocab: int, stop_token_ids: Iterable[int],
                       cache_size: int = DEFAULT_CACHE_SIZE) -> "Grammars":
        """For a Hugging Face tokenizer and a model with `vocab` logits, which may exceed the
        tokenizer's vocabulary: the engine never allows the padding ids. A tokenizer that is no
        Hugging Face one but lists its tokens' text (`pieces()`: the gateway's stand-in for the
        fake worker) is taken as a raw vocabulary."""
        stops = list(stop_token_ids)
        if hasattr(tokenizer, "pieces") and not hasattr(tokenizer, "backend_tokenizer"):
            return cls(lambda: xgr.TokenizerInfo(tokenizer.pieces(), xgr.VocabType.RAW, vocab_size=vocab,
                                                 stop_token_ids=stops), vocab, stops, cache_size)
        return cls(lambda: xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab), vocab,
                   stops, cache_size)

    def _compiler_now(self) -> xgr.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                info = self._make_info()
                if info.vocab_size != self.vocab:
                    raise ValueError(f"the tokenizer info has {info.vocab_size} ids, the model {self.vocab}")
                self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)
                self._token_ids = {}
                for i, b in enumerate(info.decoded_vocab):
                    if b:
                        self._token_ids.setdefault(b, i)
            return self._compiler

    def token_of(self, text: str) -> int | None:
        """The id of the token whose text is exactly `text`, if there is one (ties: the lowest
        id, what a BPE merge would name)."""
        self._compiler_now()
        ids = self._token_ids
        return ids.get(text.encode("utf-8")) if ids is not None else None

    def compiled(self, constraint: str) -> xgr.CompiledGrammar:
        """The compiled grammar of a constraint string (ConstraintError if it cannot be)."""
        with self._lock:
            hit = self._cache.get(constraint)
            if hit is not None:
                self._cache.move_to_end(constraint)
                return hit
        kind, schema = parse_constraint(constraint)
        try:
            # json_object: strict_mode off, so that {"type": "object"} admits any properties
            grammar = self._compiler_now().compile_json_schema(
                json.dumps(schema), any_whitespace=False, separators=_SEPARATORS,
                strict_mode=kind == "json_schema")
        except Exception as e:       # the engine raises RuntimeError/ValueError with its reason
            raise ConstraintError(f"the schema cannot be used: {e}") from None
        with self._lock:
            self._cache[constraint] = grammar
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return grammar

    def matcher(self, constraint: str, output: Sequence[int] = ()) -> xgr.GrammarMatcher:
        """A matcher for the constraint, advanced past `output` (a re-admitted request's text)."""
        m = xgr.GrammarMatcher(self.compiled(constraint), override_stop_tokens=self.stop_token_ids)
        advance(m, output)
        return m

    def bitmask(self, rows: int) -> torch.Tensor:
        return xgr.allocate_token_bitmask(rows, self.vocab)          # [rows, ceil(V / 32)] int32


def advance(matcher: xgr.GrammarMatcher, tokens: Sequence[int]) -> None:
    """Accept committed tokens. Nothing is accepted past a stop token (the output ends there), and
    a token the grammar refuses means the mask was not applied: a bug, raised."""
    for t in tokens:
        if matcher.is_terminated():
            return
        if not matcher.accept_token(int(t)):
            raise RuntimeError(f"token {t} was committed although the grammar forbids it")


class GrammarRule:
    """One request's grammar as a `NodeProcessor` (module docstring)."""

    def __init__(self, grammars: Grammars, constraint: str, output: Sequence[int] = ()):
        self.grammars = grammars
        self.matcher = grammars.matcher(constraint, output)

    def prune(self, tree: TokenTree) -> TokenTree:
        """Drop the nodes the grammar forbids on their own path (with their descendants)."""
        if not len(tree):
            return tree
        allowed = [False] * len(tree)
        kids = children(tree)
        m = self.matcher

        def walk(row: int) -> None:             # m is at `row`'s state
            if m.is_terminated():               # past a stop token: nothing follows
                return
            for c in kids[row]:
                if m.accept_token(tree.tokens[c]):
                    allowed[c] = True
                    walk(c + 1)
                    m.rollback(1)

        walk(0)
        return keep(tree, allowed)

    def adjust(self, rows: torch.Tensor, tree: TokenTree) -> None:
        """rows: [1 + n, V] float32 logits, V ≥ the grammar's vocabulary; each row's mask from its
        own path's state. The tree was pruned, so every path is one the grammar accepts."""
        n = 1 + len(tree)
        mask = self.grammars.bitmask(n)                                 # [1 + n, ceil(V / 32)]
        kids = children(tree)
        m, stops = self.matcher, self.grammars.stop_token_ids
        ended: list[int] = []                                           # rows past a stop token

        def fill(row: int) -> None:             # m is at `row`'s state
            if m.is_terminated():
                ended.append(row)
                return
            m.fill_next_token_bitmask(mask, row)
            for c in kids[row]:
                if m.accept_token(tree.tokens[c]):
                    fill(c + 1)
                    m.rollback(1)
                else:                           # not pruned: forbid everything below it
                    _forbid_below(c, kids, ended)

        fill(0)
        vocab = self.grammars.vocab
        xgr.apply_token_bitmask_inplace(rows, mask, vocab_size=min(vocab, rows.shape[1]))
        rows[:, vocab:] = float("-inf")                 # logits past the grammar's vocabulary
        for row in ended:
            # the output has ended: what follows is never used, but its choice must stay a stop
            keep_stop = rows[row, stops].clone()
            rows[row] = float("-inf")
            rows[row, stops] = keep_stop

    def commit(self, tokens: Sequence[int]) -> None:
        advance(self.matcher, tokens)


def _forbid_below(node: int, kids: list[list[int]], ended: list[int]) -> None:
    """Rows under a node the grammar refused (only when `adjust` gets an unpruned tree): treat
    them as ended, so acceptance can never pass through them to a non-stop token."""
    stack = [node]
    while stack:
        c = stack.pop()
        ended.append(c + 1)
        stack.extend(kids[c + 1])


def grammar_processors(grammars: Grammars, vocab: int) -> ProcessorFactory:
    """The rules of `sampling_processors` (penalties, logit_bias), plus the request's grammar
    when it has a constraint. The grammar goes last, so it has the last word: a biased token it
    forbids stays forbidden."""
    base = sampling_processors(vocab)

    def build(sampling: SamplingParams, output: Sequence[int]) -> list[NodeProcessor]:
        rules = base(sampling, output)
        if sampling.constraint:
            rules.append(GrammarRule(grammars, sampling.constraint, output))
        return rules
    return build
