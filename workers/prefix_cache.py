"""Prefix cache: the KV of prompt prefixes a tenant sent before, kept in blocks, so a prefill
computes only what is new.

Agentic and RAG traffic sends the same long preamble (tool schemas, instructions, documents) with
every request: on the `agentic` workload 382 of ~400 prompt tokens are shared, and on a CPU the
prefill costs more than decoding the short answer (README.md, "Agentic traffic" in the measured
section). Every serving peer caches
prefixes (vLLM's automatic prefix caching, SGLang's radix cache); this is the same idea, kept
small.

Blocks: the context is cut into blocks of `block` tokens; block i is stored under the key
(tenant, id of block i - 1, its tokens), so a block is found only after the very same prefix, and
the tokens themselves are compared (no hash can make a wrong hit). A lookup walks from the first
block while blocks are found; only whole blocks are cached.

Tenants: the tenant is part of every key, so one tenant's prompts never speed up another's
prefill: a hit would tell the second tenant, through timing, what the first one sent.

Eviction: least recently used block first, within `capacity_blocks`. A hit touches its blocks
from the last to the first, so a prefix's first blocks are always more recent than its later ones
and go last: the cache never keeps a block whose parent is gone, except until LRU reaches it.

Exactness: a key's or value's row depends only on the tokens at and before its position (causal
attention), so the cached rows are the rows a full prefill would compute. Tests compare greedy
output with and without hits.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import torch

from workers.kv_cache import KVCache

DEFAULT_BLOCK = 32


@dataclass(eq=False)
class _Block:
    id: int
    key: tuple           # (tenant, parent block's id, its tokens): where it is in the cache
    k: torch.Tensor      # [layers, kv_heads, block, head_dim]
    v: torch.Tensor


class PrefixCache:
    def __init__(self, capacity_blocks: int, block: int = DEFAULT_BLOCK) -> None:
        if capacity_blocks < 1 or block < 1:
            raise ValueError(f"need capacity_blocks >= 1 and block >= 1, got {capacity_blocks}, {block}")
        self.capacity_blocks = capacity_blocks
        self.block = block
        self._blocks: OrderedDict[tuple, _Block] = OrderedDict()   # least recently used first
        self._next_id = 0
        self.lookups = 0
        self.hit_tokens = 0          # prefill tokens served from the cache (a metric; tests)
        self.computed_tokens = 0     # prefill tokens computed
        self.block_bytes: int | None = None   # K and V of one block; set by the first one stored

    @classmethod
    def for_bytes(cls, nbytes: int, n_layers: int, n_kv_heads: int, head_dim: int,
                  dtype: torch.dtype, block: int = DEFAULT_BLOCK) -> "PrefixCache | None":
        """A cache holding at most `nbytes` of KV; None when not even one block fits."""
        per_block = 2 * n_layers * n_kv_heads * block * head_dim * torch.finfo(dtype).bits // 8
        blocks = int(nbytes // per_block)
        if blocks < 1:
            return None
        cache = cls(blocks, block)
        cache.block_bytes = per_block
        return cache

    def __len__(self) -> int:
        return len(self._blocks)

    def shrink_to(self, nbytes: int) -> None:
        """Drop least recently used blocks until at most `nbytes` are held: the cache shares its
        pool with the requests' KV and yields first (workers/verifier.py `kv_pool_bytes`)."""
        per = self.block_bytes
        if per is None:
            return
        while self._blocks and len(self._blocks) * per > nbytes:
            self._blocks.popitem(last=False)

    def usage_bytes(self) -> tuple[int, int]:
        """(bytes of KV held, bytes it may hold): how full the cache is, for a gauge (the soak's
        warm-up waits for it to level off). Both 0 until the first block shows a block's size,
        unless `for_bytes` made the cache. A plain read: /metrics calls it from another thread."""
        per = self.block_bytes or 0
        return len(self._blocks) * per, self.capacity_blocks * per

    def match(self, tenant: str, tokens: Sequence[int]) -> list[_Block]:
        """The cached blocks that spell the longest whole-block prefix of `tokens`, in order."""
        self.lookups += 1
        chain: list[_Block] = []
        parent = -1
        b = self.block
        for start in range(0, len(tokens) - b + 1, b):
            found = self._blocks.get((tenant, parent, tuple(tokens[start:start + b])))
            if found is None:
                break
            chain.append(found)
            parent = found.id
        self._touch(chain)
        return chain

    def restore(self, chain: Sequence[_Block], cache: KVCache) -> int:
        """Copy a matched chain into slots [0, n) of `cache`; returns n (cache.length is set)."""
        b = self.block
        for i, blk in enumerate(chain):
            cache.k[:, :, i * b:(i + 1) * b] = blk.k
            cache.v[:, :, i * b:(i + 1) * b] = blk.v
        cache.length = len(chain) * b
        self.hit_tokens += cache.length
        return cache.length

    def store(self, tenant: str, tokens: Sequence[int], cache: KVCache,
              chain: Sequence[_Block]) -> list[_Block]:
        """Keep the whole blocks of `tokens` (whose KV `cache` holds in slots [0, len(tokens)))
        that `chain` (what `match` found, or an earlier `store` returned) does not already hold.
        Returns the chain of `tokens`' whole blocks: a prompt prefilled in chunks is stored a
        few blocks at a time, each call passing the chain the last one returned."""
        b = self.block
        self.computed_tokens += len(tokens) - len(chain) * b
        parent = chain[-1].id if chain else -1
        added = list(chain)
        for start in range(len(chain) * b, len(tokens) - b + 1, b):
            key = (tenant, parent, tuple(tokens[start:start + b]))
            blk = self._blocks.get(key)
            if blk is None:
                blk = _Block(self._next_id, key, cache.k[:, :, start:start + b].clone(),
                             cache.v[:, :, start:start + b].clone())
                if self.block_bytes is None:
                    self.block_bytes = 2 * blk.k.numel() * blk.k.element_size()
                self._next_id += 1
                self._blocks[key] = blk
            added.append(blk)
            parent = blk.id
        self._touch(added)
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)
        return added

    def _touch(self, chain: Sequence[_Block]) -> None:
        """Mark a chain used, last block first, so its first block is the most recent."""
        for blk in reversed(chain):
            if blk.key in self._blocks:
                self._blocks.move_to_end(blk.key)
