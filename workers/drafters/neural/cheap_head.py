"""A cheap draft head (the FR-Spec idea): the draft's unembedding over the most frequent tokens only.

On a small target the unembedding is a large share of a draft's cost per token (SmolLM2-135M's
49,152 × 576 head is about as much arithmetic as several of its blocks), and most of its rows
are tokens a chat reply almost never uses. Keeping the rows of the N tokens seen most often in
text the target itself wrote cuts that cost by V / N; a token outside them can no longer be
drafted (its logit is −inf, its draft probability 0), so only acceptance can suffer, never the
output: the target still verifies every token with its full head, and multi-step speculative
sampling stays exact with q = 0 on the tokens dropped.

The kept ids live beside the draft (``head_tokens.json``); `ModelDrafter.load` and
`MemoryDrafter.load` restrict the head when they find it (`specgate draft head` writes it).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Sequence

import torch

from workers.model.cpu_linear import Linear

__all__ = ["HEAD_FILE", "count_tokens", "frequent_tokens", "CheapHead", "read_head", "write_head"]

HEAD_FILE = "head_tokens.json"


def count_tokens(sequences: Iterable[Sequence[int]], vocab: int) -> torch.Tensor:
    """How often each token id occurs in `sequences`: [vocab] int64."""
    counts = torch.zeros(vocab, dtype=torch.int64)
    for seq in sequences:
        ids = torch.as_tensor(list(seq), dtype=torch.int64)
        counts += torch.bincount(ids[(ids >= 0) & (ids < vocab)], minlength=vocab)
    return counts


def frequent_tokens(counts: torch.Tensor, n: int, always: Iterable[int] = ()) -> torch.Tensor:
    """The `n` most frequent ids (ties: the lower id first), plus `always` (stop tokens: a draft
    must be able to propose the end of a reply), sorted: [<= n + len(always)] int64.

    >>> frequent_tokens(torch.tensor([5, 0, 9, 9, 1]), 2, always=[4]).tolist()
    [2, 3, 4]
    """
    if n < 1:
        raise ValueError(f"a head keeps at least one token, got {n}")
    order = sorted(range(counts.numel()), key=lambda t: (-int(counts[t]), t))[:n]
    return torch.tensor(sorted(set(order) | {int(t) for t in always}), dtype=torch.int64)


class CheapHead:
    """hidden [R, H] -> logits [R, V]: the kept rows' logits, −inf elsewhere (the drafter's top-k
    and sampling then never pick a dropped token). Called as the `Linear` it replaces."""

    def __init__(self, weight: torch.Tensor, token_ids: torch.Tensor, backend: str = "plain"):
        self.vocab = weight.shape[0]
        self.ids = token_ids.to(weight.device)                                     # [N]
        self.linear = Linear(weight.detach()[self.ids], None, backend)             # [N, H]

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        kept = self.linear(hidden)                                                 # [R, N]
        out = kept.new_full((hidden.shape[0], self.vocab), float("-inf"))          # [R, V]
        out[:, self.ids] = kept
        return out


def write_head(path: str | Path, token_ids: torch.Tensor) -> None:
    (Path(path) / HEAD_FILE).write_text(json.dumps(token_ids.tolist()) + "\n")


def read_head(path: str | Path) -> torch.Tensor | None:
    """The kept token ids of the draft in `path`; None: it keeps its whole head."""
    f = Path(path) / HEAD_FILE
    return torch.tensor(json.loads(f.read_text()), dtype=torch.int64) if f.is_file() else None
