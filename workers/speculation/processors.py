"""Rules that change the target's logits before acceptance, applied at every row of a step's tree.

A rule that depends on the text so far (a penalty counts earlier tokens; a grammar's allowed
tokens follow what was written) must judge each tree row as plain decoding would have judged that
position: from the committed output plus that row's own path below the root (`tree.row_paths`),
never from a sibling branch. Then greedy acceptance over the adjusted rows commits exactly what
plain decoding with the same rule commits, and speculative sampling over them follows the adjusted
distribution: speculation stays lossless under the rule.

A `NodeProcessor` belongs to one request (the verifier keeps them in the request's slot):

    prune(tree)        drop draft nodes the rule forbids before the pass (a grammar: tokens it can
                       never accept would only cost rows); the default rules prune nothing
    adjust(rows, tree) change the step's logits rows [1 + n, V] in place (row 0 = the root)
    commit(tokens)     the step committed these tokens: the rule's state moves past them

`ProcessorFactory` builds a request's rules from its `SamplingParams` and the output it has
committed so far (non-empty when a request is re-admitted after eviction or a restart), so the
rules' state is rebuilt from the text, never replayed from steps.
"""
from __future__ import annotations

from collections import Counter
from typing import Callable, Protocol, Sequence

import torch

from workers.contract import SamplingParams
from workers.speculation.tree import TokenTree, row_paths


class NodeProcessor(Protocol):
    def prune(self, tree: TokenTree) -> TokenTree: ...

    def adjust(self, rows: torch.Tensor, tree: TokenTree) -> None: ...

    def commit(self, tokens: Sequence[int]) -> None: ...


ProcessorFactory = Callable[[SamplingParams, Sequence[int]], list[NodeProcessor]]


class Penalties:
    """OpenAI's presence and frequency penalties: a token's logit loses `presence` once it has
    appeared in the output and `frequency` for each time it has (the prompt does not count)."""

    def __init__(self, presence: float, frequency: float, output: Sequence[int]):
        self.presence, self.frequency = presence, frequency
        self.counts = Counter(int(t) for t in output)

    def prune(self, tree: TokenTree) -> TokenTree:
        return tree

    def adjust(self, rows: torch.Tensor, tree: TokenTree) -> None:
        """rows: [1 + n, V] float32 logits; row r's counts are the output's plus row r's path."""
        if self.counts:
            ids = torch.tensor(list(self.counts), dtype=torch.long)                        # [U]
            n = torch.tensor(list(self.counts.values()), dtype=rows.dtype)                 # [U]
            rows[:, ids] -= self.frequency * n + self.presence                              # every row
        for r, path in enumerate(row_paths(tree)):
            for tok, extra in Counter(path).items():
                before = self.counts.get(tok, 0)
                rows[r, tok] -= self.frequency * extra + (self.presence if before == 0 else 0.0)

    def commit(self, tokens: Sequence[int]) -> None:
        self.counts.update(int(t) for t in tokens)


class LogitBias:
    """OpenAI's logit_bias: a fixed amount added to chosen tokens' logits at every position."""

    def __init__(self, bias: Sequence[tuple[int, float]], vocab: int):
        known = [(t, b) for t, b in bias if t < vocab]   # ids past the vocabulary bias nothing
        self.ids = torch.tensor([t for t, _ in known], dtype=torch.long)     # [B]
        self.values = torch.tensor([b for _, b in known])                    # [B]

    def prune(self, tree: TokenTree) -> TokenTree:
        return tree

    def adjust(self, rows: torch.Tensor, tree: TokenTree) -> None:
        rows[:, self.ids] += self.values.to(rows.dtype)

    def commit(self, tokens: Sequence[int]) -> None:
        pass


def sampling_processors(vocab: int) -> ProcessorFactory:
    """The factory for the rules `SamplingParams` itself carries (penalties, logit_bias) over a
    vocabulary of `vocab` tokens. A grammar's rule needs the tokenizer too, so its factory wraps
    this one where the tokenizer is known (workers/speculation/grammar.py)."""
    def build(sampling: SamplingParams, output: Sequence[int]) -> list[NodeProcessor]:
        rules: list[NodeProcessor] = []
        if sampling.logit_bias:
            rules.append(LogitBias(sampling.logit_bias, vocab))
        if sampling.presence_penalty or sampling.frequency_penalty:
            rules.append(Penalties(sampling.presence_penalty, sampling.frequency_penalty, output))
        return rules
    return build
