"""Per-request KV storage, preallocated once, so a step never copies the committed context.

Layout: one request owns `k` and `v` of shape [layers, kv_heads, capacity, head_dim]. Slots
[0, length) hold the committed tokens' keys/values (every committed token except the root, whose
KV is computed by the next verification pass). A verification pass writes its new rows (pending
tokens, then tree nodes) to slots [length, length + rows); acceptance then keeps the pending rows
and the accepted path and forgets the rest. Only the accepted nodes that are not already in place
are moved: at most the tree depth per layer, never the context.
"""
from __future__ import annotations

import torch


class KVCache:
    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        if capacity < 1:
            raise ValueError(f"KV capacity must be >= 1, got {capacity}")
        shape = (n_layers, n_kv_heads, capacity, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)  # k: [L, Hkv, cap, D]
        self.v = torch.empty(shape, dtype=dtype, device=device)  # v: [L, Hkv, cap, D]
        self.length = 0  # committed KV slots in use

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def commit(self, n_pending: int, accepted_rows: list[int]) -> None:
        """Keep the pending rows and the accepted tree rows of the last pass; drop the rest.

        `accepted_rows` are tree-node indices (0-based, in root-to-leaf order) of the pass that wrote
        slots [length, length + n_pending + tree_size). Example: length=10, n_pending=1, accepted
        nodes [0, 2, 5] -> slot 11 stays, slots 13 and 16 move to 12 and 13, length becomes 14.
        """
        base = self.length + n_pending
        src = [base + r for r in accepted_rows]
        dst = list(range(base, base + len(accepted_rows)))
        if src != dst:
            # index_select copies the sources out first, so overlapping src/dst ranges are safe.
            src_t = torch.tensor(src, device=self.k.device)
            dst_t = torch.tensor(dst, device=self.k.device)
            self.k.index_copy_(2, dst_t, self.k.index_select(2, src_t))
            self.v.index_copy_(2, dst_t, self.v.index_select(2, src_t))
        self.length = base + len(accepted_rows)

    def grow(self, capacity: int) -> None:
        """Make room for `capacity` slots, keeping the committed ones: new tensors, the first
        `length` slots copied over (the only copy of the context a request's life makes, and only
        as often as its KV outgrows a block: workers/speculation/verifier.py)."""
        if capacity <= self.capacity:
            return
        shape = (*self.k.shape[:2], capacity, self.k.shape[3])
        k = torch.empty(shape, dtype=self.k.dtype, device=self.k.device)   # k: [L, Hkv, cap, D]
        v = torch.empty(shape, dtype=self.v.dtype, device=self.v.device)
        k[:, :, :self.length] = self.k[:, :, :self.length]
        v[:, :, :self.length] = self.v[:, :, :self.length]
        self.k, self.v = k, v

    def truncate(self, length: int) -> None:
        """Forget slots at and after `length` (used when a pass is abandoned)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate KV of length {self.length} to {length}")
        self.length = length
