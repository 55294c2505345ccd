"""Draft models: a small causal LM sharing the target's tokenizer, and its constant-size KV.

A draft directory is a Hugging Face model directory (config.json, weights, tokenizer files). One
that `specgate draft build` made (SPIRe-style: the target's embedding, a few of its blocks and its
unembedding) also holds ``specgate_draft.json``, whose ``sink`` and ``window`` give the draft
static sparse attention: a token at position p sees position j ≤ p only when j < sink (the
attention sink) or p − j < window (the sliding window). So the KV a request needs never exceeds
sink + window slots, however long it runs: at large batch the draft's memory and attention cost stay
flat. Any other causal LM directory works as a draft with full attention (window None).

The rule is one pure function, `sparse_mask`, used both by training (a [T, T] mask over a whole
sequence, `tools.distill`) and by inference (`SparseKV.past_mask`, over the cached slots), so the
draft sees at inference exactly what it was trained to see.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from workers.model.kv_cache import KVCache

SPEC_FILE = "specgate_draft.json"
DRAFT_DTYPES = ("float32", "bfloat16", "float16")

__all__ = ["SPEC_FILE", "DRAFT_DTYPES", "DraftSpec", "read_spec", "write_spec", "sparse_mask", "SparseKV"]


@dataclass(frozen=True)
class DraftSpec:
    """How a draft attends and where it came from. ``window`` None = full causal attention."""
    sink: int = 0
    window: int | None = None
    source_layers: tuple[int, ...] = ()   # the target's blocks the draft was pruned from
    target: str = ""                      # the target model it was built from (a path or name)
    distilled_steps: int = 0              # optimiser steps of `specgate distill` so far
    # Feedback memory (workers/drafters/neural/draft_memory.py): the target's blocks whose outputs the draft's
    # memory reads at committed positions, one per draft block; () = no memory.
    memory_layers: tuple[int, ...] = ()
    # The dtype the draft drafts in (training is float32 either way). The target verifies every
    # token in its own dtype, so output does not depend on it; only the draft's cost and
    # acceptance do: a bfloat16 draft reads half the bytes per token, and on CPUs with AMX /
    # AVX-512 BF16 its matmuls run on those units (workers/model/small_gemm.py).
    dtype: str = "float32"
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.sink < 0:
            raise ValueError(f"sink must be >= 0, got {self.sink}")
        if self.window is not None and self.window < 1:
            raise ValueError(f"window must be >= 1 (or None for full attention), got {self.window}")
        object.__setattr__(self, "source_layers", tuple(int(i) for i in self.source_layers))
        object.__setattr__(self, "memory_layers", tuple(int(i) for i in self.memory_layers))
        if self.dtype not in DRAFT_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DRAFT_DTYPES)}, got {self.dtype!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


def read_spec(path: str | Path) -> DraftSpec:
    """The draft's spec from ``path/specgate_draft.json``; a plain model directory: full attention."""
    f = Path(path) / SPEC_FILE
    if not f.is_file():
        return DraftSpec()
    doc = json.loads(f.read_text())
    known = {k: doc[k] for k in ("sink", "window", "source_layers", "target", "distilled_steps",
                                 "memory_layers", "dtype") if k in doc}
    return DraftSpec(**known, extra={k: v for k, v in doc.items() if k not in known})


def write_spec(path: str | Path, spec: DraftSpec) -> None:
    doc = asdict(spec)
    doc.update(doc.pop("extra"))
    doc["source_layers"] = list(spec.source_layers)
    doc["memory_layers"] = list(spec.memory_layers)
    (Path(path) / SPEC_FILE).write_text(json.dumps(doc, indent=2) + "\n")


def sparse_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, sink: int, window: int | None,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Additive mask [Q, K]: 0 where a query at position q_pos[i] may see a key at k_pos[j], else -inf.

    Visible: k ≤ q, and (k < sink or q − k < window). Example, sink 1, window 2, positions 0..3:
    row 3 sees 0 (the sink), 2 and 3; row 1 sees 0 and 1.

    >>> m = sparse_mask(torch.arange(4), torch.arange(4), 1, 2)
    >>> (m == 0).int().tolist()
    [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]]
    """
    q, k = q_pos[:, None], k_pos[None, :]
    visible = k <= q
    if window is not None:
        visible &= (k < sink) | (q - k < window)
    out = torch.zeros(visible.shape, dtype=dtype, device=q_pos.device)
    return out.masked_fill_(~visible, float("-inf"))


class SparseKV:
    """One request's draft KV: a `KVCache` plus the absolute position of each slot.

    Slots hold tokens in position order. Before a pass that adds ``rows`` tokens from position P on,
    `make_room` drops the slots no query at P or later can see again (past the sink and at least a
    window behind P) and packs the rest to the front, so with a window the cache never grows past
    sink + window + the largest pass. Without a window it doubles its capacity when full.

    Positions live beside the KV, on the draft's device, so the masks built from them (`past_mask`)
    are made there too: nothing about the committed slots crosses to the host, except when a
    windowed cache fills and `make_room` packs it (how many slots it keeps is read back: a sync
    every few steps, not every pass).
    """

    def __init__(self, new_cache, spec: DraftSpec, max_rows: int):
        self.spec = spec
        capacity = (spec.sink + spec.window + max_rows) if spec.window is not None else max(256, 2 * max_rows)
        self.cache: KVCache = new_cache(capacity)
        # pos: [capacity], absolute positions, on the KV's device
        self.pos = torch.empty(capacity, dtype=torch.long, device=self.cache.k.device)

    @property
    def length(self) -> int:
        return self.cache.length

    def make_room(self, rows: int, next_pos: int) -> None:
        c = self.cache
        if c.length + rows <= c.capacity:
            return
        if self.spec.window is not None:
            live = self.pos[: c.length]
            keep = torch.nonzero((live < self.spec.sink) | (next_pos - live < self.spec.window)).flatten()
            n = keep.numel()
            c.k[:, :, :n] = c.k.index_select(2, keep)          # index_select copies first: overlap-safe
            c.v[:, :, :n] = c.v.index_select(2, keep)
            self.pos[:n] = live[keep]
            c.length = n
        if c.length + rows > c.capacity:   # full attention (or a pass wider than planned): grow
            c.grow(max(2 * c.capacity, c.length + rows))
            pos = torch.empty(c.capacity, dtype=torch.long, device=self.pos.device)
            pos[: c.length] = self.pos[: c.length]
            self.pos = pos

    def past_mask(self, q_pos: torch.Tensor) -> torch.Tensor:
        """[rows, length] additive mask of the new rows (at positions q_pos) over the cached slots."""
        return sparse_mask(q_pos, self.pos[: self.cache.length], self.spec.sink, self.spec.window)

    def append(self, positions: torch.Tensor) -> None:
        """Keep the rows the last pass wrote after the cached slots (at `positions`)."""
        n, start = positions.numel(), self.cache.length
        self.pos[start: start + n] = positions
        self.cache.length = start + n
