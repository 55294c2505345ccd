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

`Grammars` (workers/speculation/grammars.py) compiles each distinct constraint once per process,
within bounds when serving, and holds it while a request needs it; the gateway compiles through
the same object to refuse a bad schema with a 400 before the request reaches the step loop.
`GrammarRule` is one request's `NodeProcessor`: its matcher sits after the committed output, and
each tree row's state is that matcher advanced along the row's own path (accept the path's
tokens, then roll them back), so every row is masked exactly as plain constrained decoding would
mask that position. When the grammar is complete only the stop tokens are allowed, so the request
ends there.
"""
from __future__ import annotations

from typing import Sequence

import torch
import xgrammar as xgr

from workers.contract import SamplingParams
from workers.speculation.constraints import ConstraintError, parse_constraint
from workers.speculation.grammars import Grammars, advance
from workers.speculation.processors import NodeProcessor, ProcessorFactory, sampling_processors
from workers.speculation.tree import TokenTree, children, keep

__all__ = ["ConstraintError", "Grammars", "GrammarRule", "advance", "grammar_processors", "parse_constraint"]


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
