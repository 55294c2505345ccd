"""Attention over a packed pass: each request's rows (a `Segment`) attend over that request's own
KV cache, while the linears around them run once over every row (workers/model/llama_forward.py).

What lives here is the attention's bookkeeping, apart from the layer loop: the plan of a pass
(which segments the CPU kernel serves, which torch attends for, one by one or batched; the masks
each path reads, once a pass rather than once a layer), the rope and the KV write of each layer,
and torch's per-segment attention.

Sliding-window attention: a layer with a window hides from a row at position p every key at
position p - window or earlier, on top of the segment's own masks. The plan works the windowed
masks out from the rows' `positions` and the cache's slots, since a target's cache slot j holds
position j (the verifier and the prefix cache keep it so), once a pass and only when some row is
that far along.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from workers.model import batched_attention, small_gemm
from workers.model.kv_cache import KVCache


@dataclass
class Segment:
    """One request's rows in a packed forward pass."""
    cache: KVCache
    start: int            # first packed row of this request
    rows: int             # pending tokens + tree nodes
    mask: torch.Tensor    # [rows, rows] additive float mask among the new rows (0 = visible, -inf = hidden)
    # [rows, cache.length] additive float mask over the cached slots; None = every slot visible.
    # Drafts use it: sliding-window attention, and tree nodes kept in the cache while drafting.
    past: torch.Tensor | None = None


@dataclass
class MaskSet:
    """Every segment's masks as one group of layers reads them (those sharing a window)."""
    short_masks: list[torch.Tensor]                 # the `short` segments' [rows, rows] float32
    short_pasts: list[torch.Tensor | None]          # their [rows, length] float32, None: all visible
    full_masks: dict[int, torch.Tensor]             # the `long` ones': torch's [rows, length + rows]
    batched: object = None                          # the batched ones' (batched_attention.py), if any


@dataclass
class AttentionPlan:
    """What one pass's attention needs, per segment, worked out once a pass rather than once a layer.
    `kernel`: the CPU kernels rope every row and write every segment's KV, and attend for the
    `short` segments (indices: tree steps, prefills of up to KERNEL_MAX_KEYS keys); torch attends
    for the `long` ones."""
    segments: list[Segment]
    kernel: bool
    k_caches: list[torch.Tensor] = field(default_factory=list)     # per segment [L, Hkv, cap, D]
    v_caches: list[torch.Tensor] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    short: list[int] = field(default_factory=list)
    short_caches: tuple = ()                                       # (k, v) lists of the short ones
    short_rows: tuple = ()                                         # (starts, rows, lengths) of the short ones
    short_causal: list[bool] = field(default_factory=list)
    long: list[int] = field(default_factory=list)
    chunked: dict[int, bool] = field(default_factory=dict)
    padded: batched_attention.PaddedLayout | None = None          # the batched segments' layout
    layer_masks: list[MaskSet] = field(default_factory=list)      # per layer (shared where windows agree)


# Up to this many rows a segment's attention folds its query-head groups into rows (measured with
# SmolLM2's 9/3 heads: faster than enable_gqa for tree-sized segments); longer runs such as
# prefill are as fast or faster with enable_gqa (docs/benchmarks.md, CPU kernels).
FOLD_MAX_ROWS = 32
# Segments longer than this (prefills) attend in blocks of this many rows (see `attend`); measured
# on prefill-sized segments, blocks of 64 beat 128 and 256.
CHUNK_ROWS = 64
# Segments of up to this many rows attend through the CPU kernel (tree steps, drafts' steps), and
# longer ones (prefills) up to this many keys, by KV dtype: past that torch's blocked path (above)
# is faster. Measured on SmolLM2 prefills of growing length, kernel against torch: over a float32
# KV the kernel leads for prefills of several hundred rows, over a bf16 KV (torch's bf16 flash
# attention is fast for many rows) only for short prefills.
KERNEL_MAX_ROWS = 64
KERNEL_MAX_KEYS = {torch.float32: 768, torch.bfloat16: 256}


@dataclass
class Heads:
    """The attention's shape and types, as the model's config and the forward's choices set them."""
    n_heads: int
    n_kv_heads: int
    head_dim: int
    dtype: torch.dtype              # the model's (activations)
    kv_dtype: torch.dtype           # the cache's
    device: torch.device
    attention: str                  # how torch's segments are batched (batched_attention.py)
    windows: list[int | None]       # per layer, its sliding window (None: the whole context)

    def folds(self, rows: int) -> bool:
        """Whether a segment of `rows` attends with its query-head groups folded into rows (see
        `attend`); its mask is built for that (`full_mask`), so both ask here."""
        return rows <= FOLD_MAX_ROWS and self.n_heads > self.n_kv_heads


def plan(heads: Heads, segments: list[Segment], positions: torch.Tensor, kernel: bool) -> AttentionPlan:
    """Work out once a pass what every layer's attention needs (masks, cache lists). `kernel`:
    the fused CPU attention runs (the forward's `fused_attention`)."""
    p = AttentionPlan(segments, kernel=kernel and bool(segments))
    if p.kernel:
        p.k_caches = [seg.cache.k for seg in segments]
        p.v_caches = [seg.cache.v for seg in segments]
        p.starts = [seg.start for seg in segments]
        p.rows = [seg.rows for seg in segments]
        p.lengths = [seg.cache.length for seg in segments]
        max_keys = KERNEL_MAX_KEYS.get(heads.kv_dtype, 0)
        p.short = [i for i, seg in enumerate(segments)
                   if seg.rows <= KERNEL_MAX_ROWS or seg.cache.length + seg.rows <= max_keys]
        pick = lambda values: [values[i] for i in p.short]   # noqa: E731
        p.short_caches = (pick(p.k_caches), pick(p.v_caches))
        p.short_rows = (pick(p.starts), pick(p.rows), pick(p.lengths))
        p.short_causal = [chunkable(segments[i]) for i in p.short]
    short = set(p.short)
    p.long = [i for i in range(len(segments)) if i not in short]
    p.padded = batched_attention.plan_batch(heads.attention, segments, p.long, heads.device)
    if p.padded is not None:     # those attend in one call a layer; the rest one call each
        p.long = [i for i in p.long if i not in p.padded.picked]
    p.chunked = {i: chunkable(segments[i]) for i in p.long}
    # One mask set per window that some row reaches past (a windowed mask hides more keys,
    # so a prefill stays causal and `chunked` holds); the other layers share the plain one
    # (None), built only if some layer reads it.
    top = int(positions.max()) if positions.numel() and any(heads.windows) else -1
    keys = [w if w is not None and top >= w else None for w in heads.windows]
    sets: dict[int | None, MaskSet] = {}
    for window in dict.fromkeys(keys):
        if window is None:
            own, past = [seg.mask for seg in segments], [seg.past for seg in segments]
        else:
            own, past = zip(*(windowed(seg, positions[seg.start: seg.start + seg.rows], window)
                              for seg in segments))
        sets[window] = _mask_set(heads, p, list(own), list(past))
    p.layer_masks = [sets[k] for k in keys]
    return p


def _mask_set(heads: Heads, p: AttentionPlan, masks: list[torch.Tensor],
              pasts: list[torch.Tensor | None]) -> MaskSet:
    """Each segment's masks in the form its attention path reads: float32 for the kernel's
    (`short`) segments, torch's [rows, length + rows] for the others."""
    batched = None if p.padded is None else batched_attention.pass_mask(
        heads.attention, p.padded, masks, pasts, heads.n_heads // heads.n_kv_heads, heads.kv_dtype, heads.device)
    return MaskSet(
        short_masks=[masks[i].to(torch.float32).contiguous() for i in p.short],
        short_pasts=[None if pasts[i] is None else pasts[i].to(torch.float32).contiguous() for i in p.short],
        full_masks={i: full_mask(heads, p.segments[i], masks[i], pasts[i]) for i in p.long},
        batched=batched)


def rope_store(heads: Heads, li: int, qkv: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
               p: AttentionPlan) -> torch.Tensor:
    """Rotate the rows' queries and keys and write every segment's keys and values to its
    cache; returns the queries [T, Hq, D] (kv dtype where the kernel runs, else the model's).
    qkv: [T, (Hq+2Hkv)D]; cos, sin_signed: [T, D]."""
    nq, nkv, d = heads.n_heads, heads.n_kv_heads, heads.head_dim
    if p.kernel:
        return small_gemm.rope_store(qkv, cos, sin_signed, p.k_caches, p.v_caches, li, p.starts,
                                     p.rows, p.lengths, nq, nkv)
    qkv = qkv.view(-1, nq + 2 * nkv, d)                                      # [T, Hq+2Hkv, D]
    qk = qkv[:, : nq + nkv]
    qk = qk * cos[:, None] + qk.roll(d // 2, -1) * sin_signed[:, None]        # [T, Hq+Hkv, D]
    for seg in p.segments:
        _store_kv(li, seg, qk[:, nq:], qkv[:, nq + nkv:])
    return qk[:, :nq]


def _store_kv(li: int, seg: Segment, k: torch.Tensor, v: torch.Tensor) -> None:
    cache, lo, n = seg.cache, seg.start, seg.rows
    cache.k[li, :, cache.length: cache.length + n] = k[lo: lo + n].transpose(0, 1)   # [Hkv, n, D]
    cache.v[li, :, cache.length: cache.length + n] = v[lo: lo + n].transpose(0, 1)


def attention(heads: Heads, li: int, q: torch.Tensor, p: AttentionPlan) -> torch.Tensor:
    """Every segment's rows attend over its cache: q [T, Hq, D] -> [T, Hq*D] in the model's dtype.
    The CPU kernel serves tree steps and prefills up to KERNEL_MAX_KEYS keys in one call;
    torch's kernel longer prefills, in blocks of rows that skip the keys they cannot see."""
    nq, d = heads.n_heads, heads.head_dim
    masks = p.layer_masks[li]
    if p.short:
        att = small_gemm.tree_attention(q, *p.short_caches, li, *p.short_rows, masks.short_masks,
                                        masks.short_pasts, heads.dtype, p.short_causal)  # [T, Hq*D]
        if not p.long and p.padded is None:
            return att
    elif len(p.segments) == 1:   # one request: its attention output is the whole step's
        seg = p.segments[0]
        return attend(heads, li, seg, masks.full_masks[0], q, p.chunked[0]).reshape(-1, nq * d)
    else:
        att = torch.empty(q.shape[0], nq * d, dtype=heads.dtype, device=q.device)
    rows = att.view(-1, nq, d)                                                # [T, Hq, D]
    if p.padded is not None:     # the tree-sized segments in one call (batched_attention.py)
        out = batched_attention.attend(heads.attention, q, p.padded, li, masks.batched, heads.n_kv_heads,
                                       heads.kv_dtype)                        # [T_b, Hq, D]
        rows.index_copy_(0, p.padded.out_rows, out.to(heads.dtype))
    for i in p.long:
        seg = p.segments[i]
        rows[seg.start: seg.start + seg.rows] = attend(heads, li, seg, masks.full_masks[i], q, p.chunked[i])
    return att


def attend(heads: Heads, li: int, seg: Segment, mask: torch.Tensor, q: torch.Tensor,
           chunked: bool) -> torch.Tensor:
    """Attention of the segment's rows over its cache, which holds their own KV already."""
    cache, lo, n = seg.cache, seg.start, seg.rows
    end = cache.length + n
    keys, values = cache.k[li, :, :end][None], cache.v[li, :, :end][None]   # [1, Hkv, S, D]
    q = q[lo: lo + n]
    if q.dtype != heads.kv_dtype:
        q = q.to(heads.kv_dtype)
    nkv, d = heads.n_kv_heads, heads.head_dim
    g = heads.n_heads // nkv
    if chunked:
        # Rows never see later rows, so a block of rows needs only the keys up to its own
        # last row: about half the work of one call over the whole square (and about that
        # much faster on a prefill), since torch's CPU kernel cannot skip masked blocks.
        qt = q.transpose(0, 1)[None]                                                # [1, Hq, n, D]
        out = torch.empty(n, heads.n_heads, d, dtype=q.dtype, device=q.device)     # [n, Hq, D]
        for s in range(0, n, CHUNK_ROWS):
            e = min(s + CHUNK_ROWS, n)
            upto = cache.length + e
            part = F.scaled_dot_product_attention(
                qt[:, :, s:e], keys[:, :, :upto], values[:, :, :upto],
                attn_mask=mask[s:e, :upto], enable_gqa=True)                        # [1, Hq, e-s, D]
            out[s:e] = part[0].transpose(0, 1)
    elif not heads.folds(n):
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys, values,
                                             attn_mask=mask, enable_gqa=True)   # [1, Hq, n, D]
        out = out[0].transpose(0, 1)                                           # [n, Hq, D]
    else:
        # The g query heads that share a KV head become g * n rows of that head (the mask
        # repeated g times): less attention time for tree-sized n than enable_gqa.
        qf = q.view(n, nkv, g, d).permute(1, 2, 0, 3).reshape(1, nkv, g * n, d)   # [1, Hkv, g*n, D]
        out = F.scaled_dot_product_attention(qf, keys, values, attn_mask=mask)    # [1, Hkv, g*n, D]
        out = out.view(nkv, g, n, d).permute(2, 0, 1, 3).reshape(n, nkv * g, d)     # [n, Hq, D]
    return out if out.dtype == heads.dtype else out.to(heads.dtype)


def full_mask(heads: Heads, seg: Segment, own: torch.Tensor, past: torch.Tensor | None) -> torch.Tensor:
    """torch's mask of a segment: the new rows see the committed context through `past` (None:
    all of it), each other through `own` ([rows, rows])."""
    # NOTE: the mask must be additive float: a boolean mask is silently wrong under eager attention.
    if past is not None:
        past = past.to(heads.device, heads.kv_dtype)
    else:
        past = torch.zeros(seg.rows, seg.cache.length, dtype=heads.kv_dtype, device=heads.device)
    mask = torch.cat([past, own.to(heads.device, heads.kv_dtype)], dim=1)        # [rows, length + rows]
    if heads.folds(seg.rows):
        mask = mask.repeat(heads.n_heads // heads.n_kv_heads, 1)     # [g * rows, length + rows]
    return mask


def windowed(seg: Segment, positions: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The segment's masks (own [rows, rows], past [rows, length]) with a sliding window on top:
    a row at position p no longer sees keys at position p - window or earlier. Cache slot j holds
    position j (a target's cache); positions: the segment's rows' [rows]. Example: rows at
    positions 4 and 5 over 4 cached slots, window 3: row 4 sees slots 2, 3 and itself; row 5
    sees slot 3, row 4 and itself (and what the segment's own masks let each see of those).
    """
    if not positions.numel() or int(positions.max()) < window:   # not that far along
        return seg.mask, seg.past
    slots = torch.arange(seg.cache.length, device=positions.device)
    past = _hidden(positions[:, None] - slots[None, :] >= window)                         # [rows, length]
    if seg.past is not None:
        past = past + seg.past.to(torch.float32)
    own = seg.mask.to(torch.float32) + _hidden(positions[:, None] - positions[None, :] >= window)  # [rows, rows]
    return own, past


def _hidden(far: torch.Tensor) -> torch.Tensor:
    """An additive float32 mask: -inf where `far`, else 0."""
    return torch.zeros(far.shape, dtype=torch.float32, device=far.device).masked_fill_(far, float("-inf"))


def chunkable(seg: Segment) -> bool:
    """Whether the segment is long enough to attend in blocks and no row sees a later row (true
    of prefills, trees in topological order and drafts' windows; checked, since a block drops
    the keys of later rows)."""
    n = seg.rows
    if n <= CHUNK_ROWS:
        return False
    later = torch.ones(n, n, dtype=torch.bool, device=seg.mask.device).triu(1)
    return bool(torch.isneginf(seg.mask[later]).all())
