"""The verifier's KV book: every admitted request's slot (its KV cache, root and sampling) and the
memory the slots and the prefix cache share.

KV grows in blocks of `kv_block` tokens as a request runs (`KVCache.grow`), not reserved for
prompt + max_tokens at admission: a request that omits max_tokens would otherwise hold the whole
context's KV from its first step. A request starts with room for its prompt, one block and one
tree; each time a step's tree would not fit, its KV grows by a block or by half of what it holds,
whichever is more (so a long request is copied O(log n) times), never past the model's positions.
The prefix cache keeps only what the requests' KV leaves of the pool (`kv_pool_bytes`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from workers.contract import SamplingParams
from workers.model.kv_cache import KVCache
from workers.model.llama_forward import LlamaForward
from workers.model.prefix_cache import PrefixCache
from workers.speculation.processors import NodeProcessor
from workers.speculation.tree import TokenTree, depths, truncate

KV_BLOCK = 256             # tokens of KV a request grows by (module docstring)


@dataclass
class Slot:
    """One admitted request as the verifier keeps it."""
    cache: KVCache
    root: int
    sampling: SamplingParams
    seed: int                 # with the root's position, seeds each step's RNG (step_acceptance.py)
    # the most KV slots it can ever use: its context, every token it may still produce and one
    # tree (or the model's positions, if fewer). A request whose remaining output fits what it
    # holds never grows: a grow copies the whole context, which deep in a long prompt is itself
    # a stall (the step that completed a 4,000-token prompt copied it to make room for 4 tokens)
    max_positions: int
    pending: list[int] = field(default_factory=list)   # context tokens without KV yet
    # what the prefix cache stores once the context is complete: (tenant, context, chain)
    to_store: tuple | None = None
    # rules that change the target's logits at every tree row (workers/speculation/processors.py)
    processors: list[NodeProcessor] = field(default_factory=list)


class KVBook:
    def __init__(self, target: LlamaForward, *, max_tree_tokens: int, kv_block: int,
                 kv_pool_bytes: int | None, prefix_cache: PrefixCache | None):
        if kv_block < 1:
            raise ValueError(f"kv_block must be >= 1, got {kv_block}")
        self.target = target
        self.max_tree_tokens = max_tree_tokens
        self.kv_block = kv_block
        self.kv_pool_bytes = kv_pool_bytes
        self.prefix_cache = prefix_cache     # KV of prompt prefixes seen before, per tenant id
        self.slots: dict[str, Slot] = {}

    def open(self, request_id: str, token_ids: Sequence[int], sampling: SamplingParams,
             max_new_tokens: int, tenant: str, processors: list[NodeProcessor]) -> Slot:
        """A new request's slot: a cache with room for the prompt, a block of output (less if
        fewer tokens are wanted) and one tree, holding the KV of the longest prefix of its
        context this tenant sent before; the rest of the context is `pending`."""
        limit = self.target.max_positions
        capacity = min(len(token_ids) + min(max_new_tokens, self.kv_block) + self.max_tree_tokens + 1, limit)
        cache = self.target.new_cache(capacity)
        # numpy seeds must be >= 0; an unseeded request draws its own seed once, at (re-)admission.
        seed = sampling.seed % 2**64 if sampling.seed is not None else int(np.random.SeedSequence().entropy % 2**63)
        most = min(len(token_ids) + max_new_tokens + self.max_tree_tokens + 1, limit)
        slot = Slot(cache, int(token_ids[-1]), sampling, seed, most, processors=processors)
        context = list(token_ids[:-1])
        pc = self.prefix_cache
        chain = pc.match(tenant, context) if pc is not None else []
        done = pc.restore(chain, cache) if chain else 0
        cache.length = done
        slot.pending = context[done:]
        slot.to_store = (tenant, context, chain) if pc is not None else None
        self.slots[request_id] = slot
        self.yield_pool()
        return slot

    def slot(self, request_id: str) -> Slot:
        try:
            return self.slots[request_id]
        except KeyError:
            raise KeyError(f"request {request_id!r} was not prefilled (or was released)") from None

    def complete(self, slot: Slot) -> None:
        """The context's KV is all computed: the prefix cache keeps it for later prompts."""
        if slot.to_store is not None:
            tenant, context, chain = slot.to_store
            self.prefix_cache.store(tenant, context, slot.cache, chain)
            slot.to_store = None
            self.yield_pool()

    def store_blocks(self, slot: Slot) -> None:
        """Mid-prefill: the prefix cache keeps the whole blocks computed so far (a copy of a
        block or two a step, rather than of the whole context in the step that completes it)."""
        if slot.to_store is None:
            return
        tenant, context, chain = slot.to_store
        pc = self.prefix_cache
        upto = slot.cache.length // pc.block * pc.block
        if upto > len(chain) * pc.block:
            slot.to_store = (tenant, context, pc.store(tenant, context[:upto], slot.cache, chain))
            self.yield_pool()

    def kv_tokens(self) -> int:
        """KV slots held by every admitted request (the prefix cache's blocks not counted)."""
        return sum(slot.cache.capacity for slot in self.slots.values())

    @property
    def slot_bytes(self) -> int:
        """Bytes of one KV slot: every layer's key and value for one token."""
        f = self.target
        return 2 * f.n_layers * f.n_kv_heads * f.head_dim * torch.finfo(f.kv_dtype).bits // 8

    def yield_pool(self) -> None:
        """The prefix cache keeps only what the requests' KV leaves of the pool."""
        if self.kv_pool_bytes is not None and self.prefix_cache is not None:
            self.prefix_cache.shrink_to(self.kv_pool_bytes - self.kv_tokens() * self.slot_bytes)

    def grow_ahead(self, slots: Sequence[Slot]) -> int | None:
        """Grow, at most, the one request of this step nearest to needing it, once it is within
        half a block of the room a full tree takes. Requests that run in step (equal lengths,
        equal pace) would otherwise all grow in one step, each grow a copy into fresh memory
        (mostly page faults): that step stalled every stream. Only with room in the KV pool.
        Returns its index."""
        best, best_room = None, self.kv_block // 2
        for i, slot in enumerate(slots):
            cache = slot.cache
            if slot.pending or cache.capacity >= slot.max_positions:
                continue
            room = cache.capacity - cache.length - 1 - self.max_tree_tokens
            if room < best_room:
                best, best_room = i, room
        if best is None:
            return None
        slot = slots[best]
        new = self._grown(slot)
        if self.kv_pool_bytes is not None and \
                (self.kv_tokens() + new - slot.cache.capacity) * self.slot_bytes > self.kv_pool_bytes:
            return None
        self._grow(slot, new)
        return best

    def _grown(self, slot: Slot, wanted: int = 0) -> int:
        """The capacity a request's KV grows to: by a block or by half of what it holds,
        whichever is more (at least `wanted`), never past the model's positions."""
        cache = slot.cache
        return min(slot.max_positions, max(wanted, cache.capacity + max(self.kv_block, cache.capacity // 2)))

    def _grow(self, slot: Slot, capacity: int) -> None:
        slot.cache.grow(capacity)
        self.yield_pool()

    def fit(self, slot: Slot, tree: TokenTree, chunk: int = 0) -> TokenTree:
        """The tree cut to the room the request's KV has after `chunk` context rows (grown first
        if it may), never past the verifier's `max_tree_tokens`."""
        # The chunk and the root take a KV slot and a position each; the tree gets what is left.
        cache = slot.cache
        length = cache.length + chunk
        wanted = length + 1 + min(len(tree), self.max_tree_tokens)
        if wanted > cache.capacity and cache.capacity < slot.max_positions:
            self._grow(slot, self._grown(slot, wanted))
        room = min(cache.capacity, slot.max_positions) - length - 1
        max_nodes = min(self.max_tree_tokens, room)
        if len(tree) <= max_nodes and (len(tree) == 0 or max(depths(tree)) <= room):
            return tree
        return truncate(tree, max(max_nodes, 0), max(room, 0))
