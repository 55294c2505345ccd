"""A verification step's packed rows: what each request computes in the step's one forward pass,
and the ids, positions and masks of all of them packed into one sequence (the verifier's module
docstring says what each row is).

Per request, a step computes `chunk` pending context tokens (chunked prefill), then, when that
completes its context, its root and tree; the root rides alone when only its features are wanted.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from workers.model.packed_attention import Segment
from workers.speculation.kv_book import Slot
from workers.speculation.tree import TokenTree, ancestor_mask, depths


@dataclass
class Rows:
    """One item's rows in a step's packed pass: `chunk` pending context tokens, then (when the
    context completes) the root and its tree, or the root alone for its features."""
    chunk: int
    tree: TokenTree
    decode: bool              # the root and tree are verified and committed
    root_row: bool            # the root is among the rows (decoding, or for its features)


@dataclass
class Packed:
    """Every item's rows as one sequence: the forward's inputs and where each item starts."""
    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    wanted: list[int] = field(default_factory=list)     # rows whose logits acceptance reads
    starts: list[int] = field(default_factory=list)     # each item's first row

    def forward_args(self) -> tuple:
        """(input_ids, positions, segments, logit_rows) as the lean forward takes them."""
        return (torch.tensor(self.ids), torch.tensor(self.positions), self.segments,
                torch.tensor(self.wanted) if self.wanted else None)


def pack(slots: Sequence[Slot], plans: Sequence[Rows]) -> Packed:
    """The step's rows of every item, in order; an item with no rows (its turn has not come)
    adds no segment."""
    out = Packed()
    start = 0
    for slot, rp in zip(slots, plans):
        out.starts.append(start)
        L, c, tree = slot.cache.length, rp.chunk, rp.tree
        out.ids += slot.pending[:c]
        out.positions += range(L, L + c)
        if rp.root_row:
            out.ids += [slot.root, *tree.tokens]
            out.positions += [L + c] + [L + c + d for d in depths(tree)]
            out.wanted += range(start + c, start + c + 1 + len(tree))
        rows = c + (1 + len(tree) if rp.root_row else 0)
        if rows:
            out.segments.append(Segment(slot.cache, start, rows, step_mask(c, tree if rp.root_row else None)))
        start += rows
    return out


def step_mask(chunk: int, tree: TokenTree | None) -> torch.Tensor:
    """Additive mask among one item's rows: `chunk` context rows (causal), then, when `tree` is
    given, the root and its nodes (`tree_mask`), which see every chunk row and nothing later.
    [chunk + (1 + nodes), same]."""
    if chunk == 0:
        return tree_mask(tree) if tree is not None else torch.zeros(0, 0)
    causal = torch.full((chunk, chunk), float("-inf")).triu(1)
    if tree is None:
        return causal
    m = 1 + len(tree)
    top = torch.cat([causal, torch.full((chunk, m), float("-inf"))], dim=1)    # [chunk, chunk + m]
    bottom = torch.cat([torch.zeros(m, chunk), tree_mask(tree)], dim=1)         # [m, chunk + m]
    return torch.cat([top, bottom])


def tree_mask(tree: TokenTree) -> torch.Tensor:
    """Additive mask among a step's new rows: [1 + n, 1 + n]; row 0 is the root.

    Example: tree tokens (a, b, c), parents (-1, 0, -1) -> row 0 sees {root}; row 1 (a) sees
    {root, a}; row 2 (b) sees {root, a, b}; row 3 (c) sees {root, c}.
    """
    n = len(tree)
    visible = np.zeros((n + 1, n + 1), dtype=bool)
    visible[:, 0] = True
    if n:
        visible[1:, 1:] = ancestor_mask(tree)
    mask = torch.zeros(n + 1, n + 1)
    mask[~torch.from_numpy(visible)] = float("-inf")
    return mask
