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
prefill: a hit would tell the second tenant, through timing, what the first one sent. The tenant
here is the tenant's immutable id (`gateway.tenancy.records.Tenant.id`), never its name: a tenant
removed and created again under the same name is another tenant and must not hit the old one's
blocks. `drop_tenant` frees a removed tenant's blocks and refuses to store any more for it.

Eviction: each tenant's blocks are kept least recently used first, and
  * a tenant holds at most `tenant_blocks` (a share of the capacity): past it, its own least
    recently used block goes;
  * when the cache is full, the least recently used block of the tenant holding the most goes.
So one tenant's many distinct prompts evict its own blocks, never those of a tenant holding fewer
(without this, one tenant's prefills flushed every other tenant's prefixes: their next prefill
cost the whole prompt, and the loss of a hit told them someone else was busy). A hit touches its
blocks from the last to the first, so a prefix's first blocks are always more recent than its
later ones and go last: the cache never keeps a block whose parent is gone, except until LRU
reaches it.

Exactness: a key's or value's row depends only on the tokens at and before its position (causal
attention), so the cached rows are the rows a full prefill would compute. Tests compare greedy
output with and without hits.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import torch

from workers.model.kv_cache import KVCache

DEFAULT_BLOCK = 32
DEFAULT_TENANT_SHARE = 0.5   # of the capacity, the most one tenant's blocks may take


@dataclass(eq=False)
class _Block:
    id: int
    key: tuple           # (tenant, parent block's id, its tokens): where it is in the cache
    k: torch.Tensor      # [layers, kv_heads, block, head_dim]
    v: torch.Tensor


class PrefixCache:
    def __init__(self, capacity_blocks: int, block: int = DEFAULT_BLOCK,
                 tenant_share: float = DEFAULT_TENANT_SHARE) -> None:
        """`tenant_share`: the fraction of `capacity_blocks` one tenant's blocks may take (at
        least one block; 1.0: no cap but the capacity)."""
        if capacity_blocks < 1 or block < 1:
            raise ValueError(f"need capacity_blocks >= 1 and block >= 1, got {capacity_blocks}, {block}")
        if not 0 < tenant_share <= 1:
            raise ValueError(f"tenant_share must be in (0, 1], got {tenant_share}")
        self.capacity_blocks = capacity_blocks
        self.block = block
        self.tenant_blocks = max(1, int(capacity_blocks * tenant_share))
        self._blocks: dict[tuple, _Block] = {}                   # every block, by key
        self._lru: dict[str, OrderedDict[tuple, _Block]] = {}    # per tenant, least recent first
        # Ids of removed tenants: nothing is stored for them again (a request of theirs still
        # running when they were removed). Ids are never reused, so this only grows, by one short
        # string per removal.
        self._dropped: set[str] = set()
        self._next_id = 0
        self.lookups = 0
        self.hit_tokens = 0          # prefill tokens served from the cache (a metric; tests)
        self.computed_tokens = 0     # prefill tokens computed
        self.block_bytes: int | None = None   # K and V of one block; set by the first one stored

    @classmethod
    def for_bytes(cls, nbytes: int, n_layers: int, n_kv_heads: int, head_dim: int,
                  dtype: torch.dtype, block: int = DEFAULT_BLOCK,
                  tenant_share: float = DEFAULT_TENANT_SHARE) -> "PrefixCache | None":
        """A cache holding at most `nbytes` of KV; None when not even one block fits."""
        per_block = 2 * n_layers * n_kv_heads * block * head_dim * torch.finfo(dtype).bits // 8
        blocks = int(nbytes // per_block)
        if blocks < 1:
            return None
        cache = cls(blocks, block, tenant_share)
        cache.block_bytes = per_block
        return cache

    def __len__(self) -> int:
        return len(self._blocks)

    def shrink_to(self, nbytes: int) -> None:
        """Drop least recently used blocks until at most `nbytes` are held: the cache shares its
        pool with the requests' KV and yields first (workers/speculation/verifier.py `kv_pool_bytes`)."""
        per = self.block_bytes
        if per is None:
            return
        while self._blocks and len(self._blocks) * per > nbytes:
            self._evict_one()

    def usage_bytes(self) -> tuple[int, int]:
        """(bytes of KV held, bytes it may hold): how full the cache is, for a gauge (the soak's
        warm-up waits for it to level off). Both 0 until the first block shows a block's size,
        unless `for_bytes` made the cache. A plain read: /metrics calls it from another thread."""
        per = self.block_bytes or 0
        return len(self._blocks) * per, self.capacity_blocks * per

    def tenant_len(self, tenant: str) -> int:
        """Blocks `tenant` holds now."""
        lru = self._lru.get(tenant)
        return 0 if lru is None else len(lru)

    def drop_tenant(self, tenant: str) -> int:
        """Free every block of a removed tenant and store none for it from now on (module
        docstring). Returns the blocks freed."""
        self._dropped.add(tenant)
        lru = self._lru.pop(tenant, None)
        if lru is None:
            return 0
        for key in lru:
            del self._blocks[key]
        return len(lru)

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
        if tenant in self._dropped:
            return list(chain)
        parent = chain[-1].id if chain else -1
        added = list(chain)
        lru = self._lru.setdefault(tenant, OrderedDict())
        for start in range(len(chain) * b, len(tokens) - b + 1, b):
            key = (tenant, parent, tuple(tokens[start:start + b]))
            blk = self._blocks.get(key)
            if blk is None:
                blk = _Block(self._next_id, key, cache.k[:, :, start:start + b].clone(),
                             cache.v[:, :, start:start + b].clone())
                if self.block_bytes is None:
                    self.block_bytes = 2 * blk.k.numel() * blk.k.element_size()
                self._next_id += 1
                self._blocks[key] = lru[key] = blk
            added.append(blk)
            parent = blk.id
        self._touch(added)
        while len(lru) > self.tenant_blocks:              # over its share: its own LRU goes
            self._evict_one(tenant)
        while len(self._blocks) > self.capacity_blocks:   # full: the largest tenant's LRU goes
            self._evict_one()
        return added

    def _evict_one(self, tenant: str | None = None) -> None:
        """Drop the least recently used block of `tenant`, or of the tenant holding the most."""
        if tenant is None:
            tenant = max(self._lru, key=lambda t: len(self._lru[t]))
        lru = self._lru[tenant]
        key, _ = lru.popitem(last=False)
        del self._blocks[key]
        if not lru:
            del self._lru[tenant]

    def _touch(self, chain: Sequence[_Block]) -> None:
        """Mark a chain used, last block first, so its first block is the most recent."""
        for blk in reversed(chain):
            lru = self._lru.get(blk.key[0])
            if lru is not None and blk.key in lru:
                lru.move_to_end(blk.key)
