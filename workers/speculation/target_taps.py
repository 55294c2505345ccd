"""The target's activations for a feedback-memory draft: from a verification pass to the drafter.

A draft with feedback memory (workers/drafters/neural/draft_memory.py) reads, at every committed position, the
target's token embedding and the outputs of a few of its blocks (`TapSpec`). The verifier computes
them anyway in the pass that commits the position; these helpers pick the rows that pass
committed and the draft can still read (`TapSpec.keeps`), and turn them into the plain
`TargetTaps` that cross to the drafter (in Ray mode, to another process) and back into a tensor.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from workers.contract import TapSpec, TargetTaps

__all__ = ["pack", "unpack", "gather", "committed_taps"]


def pack(positions: Sequence[int], values: torch.Tensor) -> TargetTaps:
    """values: [N, S, H] (any float dtype) at `positions` ([N]) -> TargetTaps (float32 bytes)."""
    v = values.detach().to("cpu", torch.float32).contiguous()
    if v.dim() != 3 or v.shape[0] != len(positions):
        raise ValueError(f"values {tuple(v.shape)} do not match {len(positions)} positions")
    return TargetTaps(tuple(int(p) for p in positions), v.shape[1], v.shape[2], v.numpy().tobytes())


def unpack(taps: TargetTaps) -> tuple[list[int], torch.Tensor]:
    """(positions, values [N, S, H] float32): the inverse of `pack`."""
    arr = np.frombuffer(taps.data, dtype=np.float32).reshape(len(taps.positions), taps.taps, taps.hidden)
    return list(taps.positions), torch.from_numpy(arr.copy())


def gather(chunks: Sequence[TargetTaps | None], spec: TapSpec | None = None,
           newest: int | None = None) -> TargetTaps | None:
    """One TargetTaps holding every chunk's rows (a position in several: the latest chunk's
    values, though they agree), in position order; with `spec`, only the rows the draft can
    still read once its newest position is `newest` (default: the newest row's). A lone chunk
    is returned as it is."""
    chunks = [c for c in chunks if c is not None]
    if len(chunks) <= 1:
        return chunks[0] if chunks else None
    rows: dict[int, torch.Tensor] = {}
    for taps in chunks:
        pos, vals = unpack(taps)
        rows.update(zip(pos, vals))
    keep = sorted(rows)
    if spec is not None:
        last = keep[-1] if newest is None else newest
        keep = [p for p in keep if spec.keeps(p, last)]
    return pack(keep, torch.stack([rows[p] for p in keep])) if keep else None


def committed_taps(spec: TapSpec, positions: Sequence[int], values: torch.Tensor,
                   newest: int) -> TargetTaps | None:
    """The rows (committed, at `positions`, values [N, S, H]) the draft can still read once its
    newest position is `newest`; None when none.

    Example: sink 1, window 2, positions 0..5 committed, newest 6 -> rows at 0 and 5 (6 itself is
    the new root, whose activations no pass has computed yet).
    """
    keep = [i for i, p in enumerate(positions) if spec.keeps(p, newest)]
    if not keep:
        return None
    return pack([positions[i] for i in keep], values[keep])
