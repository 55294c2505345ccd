"""Tree attention for every request of a step in one call: the device-generic path's options.

Why: without the CPU kernel (workers/model/csrc/attention.cpp, which takes every request in one call),
the lean forward attends one request at a time (`packed_attention.attend`): per layer, one SDPA
call per request. On a GPU each call is a launch plus Python, whatever its size, so a batch of B
small trees costs B launches a layer. The options, chosen by `SPECGATE_ATTENTION` (or
`LlamaForward(attention=...)`):

    loop     one SDPA call per request (the forward's own `_attend`)
    padded   the tree-sized segments' query rows and KV gathered into padded batches, one SDPA
             call a layer with an additive mask [B, 1, g*R, S] built once a pass from each
             segment's own masks (its tree's parent pointers) and its KV length. The gather
             copies each request's KV once a layer: the price of the one call
    flex     the same padded tensors, `flex_attention` with a block mask built once a pass from
             the same visibility (compiled on CUDA; eager elsewhere, which only tests use)

`auto` is `loop` on every device until a GPU run measures the others (issue 33: scripts/
gpu_check.sh reports the step time of each); `default_attention` is the one place that decides.
Segments longer than `BATCH_MAX_ROWS` (prefill chunks) keep their own call: padding every tree
to a prefill's rows would cost more than the launches it saves.

Layout of one pass (B batched segments, R = their most rows, S = their most keys rounded up to
`KEY_ALIGN`): a padded query row (b, r) reads packed row `start_b + r` (r < rows_b; pad rows read
row 0 and see key 0 only, so they stay finite; their output is dropped); padded key slot (b, s)
reads slot s of request b's cache (s < length_b + rows_b; pad slots read a zero row, hidden).
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workers.model.kv_cache import KVCache

ATTENTION_CHOICES = ("auto", "loop", "padded", "flex")
BATCH_MAX_ROWS = 320     # tree-sized segments (a 256-node tree, its root and a chunk) are batched
KEY_ALIGN = 8            # padded key length: a multiple of this, as CUDA's fused kernels want


def default_attention(device: torch.device) -> str:
    """What 'auto' picks on `device`.
    NOTE: 'loop' everywhere until the GPU run owed on issue 33 measures padded and flex."""
    return "loop"


def resolve_attention(name: str | None, device: torch.device) -> str:
    """`name` (None: SPECGATE_ATTENTION, else 'auto') as one of loop, padded, flex."""
    choice = (name or os.environ.get("SPECGATE_ATTENTION", "") or "auto").strip().lower()
    if choice not in ATTENTION_CHOICES:
        raise ValueError(f"attention must be one of {', '.join(ATTENTION_CHOICES)}, not {choice!r}")
    return default_attention(torch.device(device)) if choice == "auto" else choice


@dataclass
class PaddedLayout:
    """Where the batched segments' rows and keys sit in the padded tensors (module docstring)."""
    picked: list[int]            # indices of the batched segments among the pass's
    caches: list[KVCache]
    ends: list[int]              # per segment: its cached length + its rows (the keys it reads)
    rows: int                    # R: the most rows of a segment
    keys: int                    # S: the most keys, rounded up to KEY_ALIGN
    q_index: torch.Tensor        # [B*R] packed row each padded query row reads
    out_index: torch.Tensor      # [T_b] padded row of each batched row, in packed order
    out_rows: torch.Tensor       # [T_b] its packed row
    kv_index: torch.Tensor       # [B*S] slot of the segments' concatenated keys (the last: a zero row)
    lengths: torch.Tensor        # [B, 1, 1] cached length of each segment (mask building)
    row_counts: torch.Tensor     # [B, 1, 1] rows of each segment

    @property
    def batch(self) -> int:
        return len(self.picked)


def plan_batch(kind: str, segments, candidates: list[int], device: torch.device) -> PaddedLayout | None:
    """The layout of the segments among `candidates` (indices of the pass's segments that torch
    attends for) that `kind` batches: those of up to BATCH_MAX_ROWS rows, when there are two or
    more (one alone gains nothing from a padded copy of its KV). None: every one keeps its call."""
    picked = [i for i in candidates if segments[i].rows <= BATCH_MAX_ROWS] if kind != "loop" else []
    return plan_layout(segments, picked, device) if len(picked) > 1 else None


def plan_layout(segments, picked: list[int], device: torch.device) -> PaddedLayout:
    """The padded layout of segments `picked` (Segment objects of one pass), indices on `device`
    (built on the host, one copy each)."""
    segs = [segments[i] for i in picked]
    rows = max(s.rows for s in segs)
    ends = [s.cache.length + s.rows for s in segs]
    keys = -(-max(ends) // KEY_ALIGN) * KEY_ALIGN
    q_index, out_index, out_rows, kv_index = [], [], [], []
    offset, total = 0, sum(ends)
    for b, s in enumerate(segs):
        q_index += [s.start + r for r in range(s.rows)] + [0] * (rows - s.rows)
        out_index += range(b * rows, b * rows + s.rows)
        out_rows += range(s.start, s.start + s.rows)
        kv_index += [offset + j for j in range(ends[b])] + [total] * (keys - ends[b])
        offset += ends[b]
    as_index = functools.partial(torch.tensor, dtype=torch.long, device=device)
    return PaddedLayout(picked, [s.cache for s in segs], ends, rows, keys, as_index(q_index), as_index(out_index),
                        as_index(out_rows), as_index(kv_index),
                        as_index([s.cache.length for s in segs]).view(-1, 1, 1),
                        as_index([s.rows for s in segs]).view(-1, 1, 1))


def visible(layout: PaddedLayout, owns: list[torch.Tensor], pasts: list[torch.Tensor | None],
            device: torch.device) -> torch.Tensor:
    """[B, R, S] bool: which padded key slot each padded query row sees. Row r of segment b sees
    slot s < length_b where its `past` mask allows (None: all), and slot length_b + j where its
    own mask [rows_b, rows_b] shows row j; pad rows see slot 0 alone.

    Example: one segment, length 2, rows 2 with own mask [[0, -inf], [0, 0]], R 2, S 8: row 0
    sees slots 0, 1, 2; row 1 sees 0, 1, 2, 3.
    """
    B, R, S = layout.batch, layout.rows, layout.keys
    own = torch.zeros(B, R, R, dtype=torch.bool, device=owns[0].device)       # [B, R, R]
    for b, m in enumerate(owns):
        own[b, : m.shape[0], : m.shape[1]] = m == 0
    own = own.to(device)
    slots = torch.arange(S, device=device).view(1, 1, S)                        # [1, 1, S]
    rel = slots - layout.lengths                                                # [B, 1, S]: index among own rows
    in_own = (rel >= 0) & (rel < layout.row_counts)
    seen = own.gather(2, rel.clamp(0, R - 1).expand(B, R, S)) & in_own           # [B, R, S]
    seen |= slots < layout.lengths
    for b, past in enumerate(pasts):
        if past is not None:
            n, length = past.shape
            seen[b, :n, :length] &= past.to(device) == 0
    real = torch.arange(R, device=device).view(1, R, 1) < layout.row_counts      # [B, R, 1]
    seen &= real
    seen[:, :, 0] |= ~real[:, :, 0]
    return seen


def pass_mask(kind: str, layout: PaddedLayout, owns: list[torch.Tensor], pasts: list[torch.Tensor | None],
              groups: int, dtype: torch.dtype, device: torch.device):
    """The mask `attend` reads for one pass (and one window): `additive_folded` (padded) or
    `block_mask` (flex); `owns`, `pasts`: every segment's of the pass (the picked ones read)."""
    seen = visible(layout, [owns[i] for i in layout.picked], [pasts[i] for i in layout.picked], device)
    return additive_folded(seen, groups, dtype) if kind == "padded" else block_mask(seen)


def additive_folded(seen: torch.Tensor, groups: int, dtype: torch.dtype) -> torch.Tensor:
    """The `padded` option's mask: [B, 1, g*R, S] additive (0 visible, -inf hidden), its rows
    repeated once per query head sharing a KV head (`attend` folds those heads into rows)."""
    mask = torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill_(~seen, float("-inf"))
    return mask.repeat(1, groups, 1)[:, None]


def block_mask(seen: torch.Tensor):
    """The `flex` option's mask: a BlockMask over [B, R, S] from the same visibility."""
    from torch.nn.attention.flex_attention import create_block_mask

    B, R, S = seen.shape
    return create_block_mask(lambda b, h, q, k: seen[b, q, k], B=B, H=None, Q_LEN=R, KV_LEN=S,
                             device=seen.device)


def gather_kv(layout: PaddedLayout, li: int, heads_kv: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer `li`'s keys and values of the batched segments, padded: [B, Hkv, S, D] each. One
    concatenation and one index_select per tensor (no per-request copy kernel)."""
    out = []
    for which in ("k", "v"):
        parts = [getattr(c, which)[li, :, :end] for c, end in zip(layout.caches, layout.ends)]   # [Hkv, end, D]
        parts.append(parts[0].new_zeros(heads_kv, 1, head_dim))
        flat = torch.cat(parts, dim=1)                                              # [Hkv, sum ends + 1, D]
        padded = flat.index_select(1, layout.kv_index)                              # [Hkv, B*S, D]
        out.append(padded.view(heads_kv, layout.batch, layout.keys, head_dim).transpose(0, 1))
    return out[0], out[1]


def attend(kind: str, q: torch.Tensor, layout: PaddedLayout, li: int, mask, heads_kv: int,
           kv_dtype: torch.dtype) -> torch.Tensor:
    """The batched segments' attention for layer `li`: q [T, Hq, D] (the pass's packed queries,
    their KV already in the caches) -> [T_b, Hq, D] in packed order (`layout.out_rows`).
    `mask`: `additive_folded`'s (padded) or `block_mask`'s (flex)."""
    _, nq, d = q.shape
    B, R, g = layout.batch, layout.rows, nq // heads_kv
    k, v = gather_kv(layout, li, heads_kv, d)                                        # [B, Hkv, S, D]
    qp = q.index_select(0, layout.q_index).to(kv_dtype).view(B, R, nq, d)          # [B, R, Hq, D]
    if kind == "padded":
        # the g query heads that share a KV head become g*R rows of it (as `_attend` folds)
        qf = qp.view(B, R, heads_kv, g, d).permute(0, 2, 3, 1, 4).reshape(B, heads_kv, g * R, d)
        out = F.scaled_dot_product_attention(qf, k, v, attn_mask=mask)              # [B, Hkv, g*R, D]
        out = out.view(B, heads_kv, g, R, d).permute(0, 3, 1, 2, 4).reshape(B * R, nq, d)
    elif kind == "flex":
        out = _flex(q.device)(qp.transpose(1, 2), k, v, block_mask=mask, enable_gqa=g > 1)   # [B, Hq, R, D]
        out = out.transpose(1, 2).reshape(B * R, nq, d)
    else:
        raise ValueError(f"no batched attention {kind!r}")
    return out.index_select(0, layout.out_index)                                      # [T_b, Hq, D]


@functools.lru_cache(maxsize=None)
def _flex(device: torch.device):
    """flex_attention, compiled where it runs on CUDA (eager it materialises every score: what
    a test on the CPU can afford, never a GPU step)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True) if device.type == "cuda" else flex_attention
