"""The verifier: one forward pass of the target checks the token trees of every request in a batch.

Per request it keeps a preallocated KV cache holding every committed token except the root (the
last committed token). A step feeds, for each request, the root followed by its tree nodes:

    row 0      = the root, at position L (L = committed KV length)
    row i + 1  = tree node i, at position L + depth(i), seeing the context, the root and its ancestors

The logits at row r predict the token after row r, so row 0 checks the root's children and the
bonus comes from the deepest accepted row. After acceptance the root and the accepted nodes' KV are
kept in place (`KVCache.commit`), the rest is forgotten, and the bonus token becomes the new root.

Chunked prefill: a request admitted with `prefill(..., defer=True)` gets its KV (and any prefix-cache
hit) but computes none of its context; each step then computes up to `VerifyItem.prefill` pending
context tokens in the same pass as every other request's rows. The step that completes the context
appends the root and its tree to the same segment:

    rows 0 .. c-1   = the chunk's context tokens, at positions L .. L+c-1 (causal among themselves)
    row c           = the root, at position L+c, then tree node i at L+c+depth(i)

so the first step of a chunked request is the same arithmetic as a whole prefill followed by a
plain step (same positions, same keys visible), and greedy output is identical.

The rooms: the slots and the KV memory they share, growth and the prefix cache
(workers/speculation/kv_book.py); a step's packed rows and masks (packed_rows.py); one request's
acceptance from its logits rows (step_acceptance.py). This module runs the passes and commits.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Sequence

import torch

from workers.contract import ContextLengthError, Prefilled, SamplingParams, StepResult, TapSpec
from workers.model.llama_forward import LlamaForward, Segment
from workers.model.prefix_cache import PrefixCache
from workers.speculation.kv_book import KV_BLOCK, KVBook, Slot
from workers.speculation.packed_rows import Rows, pack
from workers.speculation.processors import ProcessorFactory, sampling_processors
from workers.speculation.step_acceptance import accept, committed_logprobs
from workers.speculation.target_taps import committed_taps
from workers.speculation.tree import TokenTree

__all__ = ["KV_BLOCK", "StepTimings", "Verifier", "VerifyItem", "committed_logprobs"]

_EMPTY = TokenTree.empty()


@dataclass(frozen=True)
class VerifyItem:
    request_id: str
    tree: TokenTree
    prefill: int = 0          # pending context tokens to compute first (module docstring)
    decode: bool = True       # verify the root and tree if the context is then complete


@dataclass
class StepTimings:
    """Where a step's wall time went, accumulated over steps (seconds)."""
    forward_s: float = 0.0
    other_s: float = 0.0
    steps: int = 0


class Verifier:
    def __init__(self, target: LlamaForward, *, max_tree_tokens: int = 64,
                 prefix_cache: PrefixCache | None = None, features: bool = False,
                 kv_block: int = KV_BLOCK, kv_pool_bytes: int | None = None,
                 processors: ProcessorFactory | None = None, taps: TapSpec | None = None):
        """`features`: report each request's hidden state with its step result
        (`StepResult.features`); `kv_block`: tokens of KV a request grows by (kv_book.py);
        `kv_pool_bytes`: the KV memory requests and the prefix cache share; the prefix cache
        gives up blocks whenever the requests' KV needs them (the planner keeps the requests'
        KV within this pool: scheduler/kv_budget.py); `processors`: builds each request's
        logit rules (workers/speculation/processors.py; default: penalties and logit_bias); `taps`: the
        target activations a feedback-memory draft reads, returned for every committed row
        (`StepResult.taps`, `Prefilled.taps`; workers/speculation/target_taps.py)."""
        self.book = KVBook(target, max_tree_tokens=max_tree_tokens, kv_block=kv_block,
                           kv_pool_bytes=kv_pool_bytes, prefix_cache=prefix_cache)
        self.target = target
        self.features = features
        self.taps = taps
        self.max_tree_tokens = max_tree_tokens
        self.processors = processors or sampling_processors(target.vocab_size)
        self.timings = StepTimings()

    @property
    def context_limit(self) -> int:
        return self.target.max_positions

    @property
    def kv_block(self) -> int:
        return self.book.kv_block

    @property
    def kv_pool_bytes(self) -> int | None:
        return self.book.kv_pool_bytes

    @property
    def prefix_cache(self) -> PrefixCache | None:
        return self.book.prefix_cache

    def active(self) -> list[str]:
        return list(self.book.slots)

    def prefill(self, request_id: str, token_ids: Sequence[int], sampling: SamplingParams,
                max_new_tokens: int, tenant: str = "default", *, defer: bool = False,
                prompt_len: int | None = None) -> Prefilled:
        """Admit a request: compute the KV of every token but the last, which becomes the root.

        `token_ids` is the prompt, or prompt + committed output when a request is re-admitted
        (restart recovery re-prefills, it never replays steps). With a prefix cache, the KV of
        the longest prefix this tenant sent before is copied in and only the rest is computed.
        Returns how many tokens' KV came from the prefix cache, and with `features` the root's
        hidden state: the root then rides along in the same pass (its KV is written past the
        context and overwritten by the first step), so a predictor has it before any step.
        `defer`: compute nothing past the prefix cache's hit; steps compute the rest in chunks
        (module docstring), and `Prefilled.pending` says how many tokens that is.
        `prompt_len`: where the prompt ends in `token_ids` (None: all of it), so logit rules that
        read the output so far (penalties, a grammar) start from the committed output.
        """
        if request_id in self.book.slots:
            raise ValueError(f"request {request_id!r} is already admitted")
        if len(token_ids) == 0:
            raise ValueError("prompt is empty: at least one token is needed")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if len(token_ids) >= self.context_limit:
            raise ContextLengthError(
                f"prompt has {len(token_ids)} tokens; the model's context is {self.context_limit} tokens")
        rules = []
        if sampling.adjusts_logits:
            output = token_ids[len(token_ids) if prompt_len is None else prompt_len:]
            rules = self.processors(sampling, [int(t) for t in output])
        slot = self.book.open(request_id, token_ids, sampling, max_new_tokens, tenant, rules)
        done = slot.cache.length
        features = taps = None
        if not (defer and slot.pending):         # whole prefill, or a whole-context cache hit
            if slot.pending or self.features:
                features, taps = self._prefill_pass(slot)
            self.book.complete(slot)
        return Prefilled(done, features, len(slot.pending), slot.cache.capacity, taps=taps)

    def _prefill_pass(self, slot: Slot) -> tuple:
        """Compute every pending context token in one pass of its own (whole prefill); with
        `features` the root rides along. Returns (root features or None, context taps or None)."""
        rows = slot.pending + ([slot.root] if self.features else [])
        n, done, c = len(rows), slot.cache.length, len(slot.pending)
        causal = torch.full((n, n), float("-inf")).triu(1)
        wanted = torch.tensor([n - 1]) if self.features else None
        args = (torch.tensor(rows), torch.arange(done, done + n), [Segment(slot.cache, 0, n, causal)], wanted)
        taps = None
        if self.taps is None:
            _, hidden = self.target.forward_hidden(*args)                                  # [1, H]
        else:
            _, hidden, values = self.target.forward_taps(*args, self.taps.layers)          # [n, S, H]
            taps = committed_taps(self.taps, range(done, done + c), values[:c], done + c)
        slot.cache.length = done + c
        slot.pending = []
        return (None if hidden is None else tuple(hidden[0].float().tolist())), taps

    def pending(self, request_id: str) -> int:
        """Context tokens of an admitted request whose KV no step has computed yet."""
        return len(self.book.slot(request_id).pending)

    def kv_tokens(self) -> int:
        """KV slots held by every admitted request (the prefix cache's blocks not counted)."""
        return self.book.kv_tokens()

    @property
    def kv_budget_slots(self) -> int | None:
        """KV slots the pool holds (the planner's budget: scheduler/kv_budget.py); None: no pool."""
        return None if self.kv_pool_bytes is None else self.kv_pool_bytes // self.slot_bytes

    @property
    def slot_bytes(self) -> int:
        """Bytes of one KV slot: every layer's key and value for one token."""
        return self.book.slot_bytes

    def release(self, request_id: str) -> None:
        """Forget a request and free its KV (idempotent)."""
        self.book.slots.pop(request_id, None)

    def drop_tenant(self, tenant: str) -> None:
        """A removed tenant (its immutable id): its prefix-cache blocks go, and none are stored
        for it again (`PrefixCache.drop_tenant`)."""
        if self.prefix_cache is not None:
            self.prefix_cache.drop_tenant(tenant)

    def verify(self, batch: Sequence[VerifyItem]) -> list[StepResult]:
        """One forward pass over the prefill chunks, roots and trees of every request in `batch`."""
        t0 = time.perf_counter()
        slots = [self.book.slot(item.request_id) for item in batch]
        plans = [self._rows(slot, item) for slot, item in zip(slots, batch)]
        packed = pack(slots, plans)
        t1 = time.perf_counter()
        logits = hidden = values = None
        if packed.segments:
            args = packed.forward_args()
            if self.taps is None:
                logits, hidden = self.target.forward_hidden(*args)                  # [R, V], [R, H]
            else:
                logits, hidden, values = self.target.forward_taps(*args, self.taps.layers)   # [T, S, H]
        t2 = time.perf_counter()
        results = []
        greedy_rows = (self.target.argmax(logits) if any(s.sampling.greedy and rp.decode
                                                         for s, rp in zip(slots, plans)) else None)
        lo = 0                                   # this item's first row among the logits rows
        for item, slot, rp, first in zip(batch, slots, plans, packed.starts):
            c, tree = rp.chunk, rp.tree
            features = logprobs = None
            length = slot.cache.length
            if rp.decode:
                acc = accept(slot, tree, lo, logits, greedy_rows, slot.cache.length + c, self.target.argmax)
                if slot.sampling.logprobs is not None:
                    logprobs = committed_logprobs(logits[lo: lo + 1 + len(tree)], acc,
                                                  slot.sampling.logprobs)
                for rule in slot.processors:
                    rule.commit(acc.tokens)
                slot.cache.commit(c + 1, list(acc.path))
                slot.root = acc.tokens[-1]
                tokens, accepted, drafted = acc.tokens, acc.accepted, len(tree)
                if self.features:
                    features = tuple(hidden[lo + (acc.path[-1] + 1 if acc.path else 0)].float().tolist())
            else:
                slot.cache.commit(c, [])
                tokens, accepted, drafted = (), 0, 0
                if rp.root_row and self.features:
                    features = tuple(hidden[lo].float().tolist())
            taps = None
            if values is not None:
                # the rows this step committed: the chunk, then the root and the accepted nodes
                kept = list(range(c)) + ([c, *(c + 1 + i for i in acc.path)] if rp.decode else [])
                newest = length + len(kept) if rp.decode else length + len(slot.pending)
                taps = committed_taps(self.taps, range(length, length + len(kept)),
                                      values[[first + r for r in kept]], newest)
            if c:
                del slot.pending[:c]
                if slot.pending:
                    self.book.store_blocks(slot)
                else:
                    self.book.complete(slot)
            if rp.root_row:
                lo += 1 + len(tree)
            results.append(StepResult(item.request_id, tokens, accepted, drafted, features=features,
                                      prefilled=c, pending=len(slot.pending),
                                      kv_tokens=slot.cache.capacity, logprobs=logprobs, taps=taps))
        grown = self.book.grow_ahead(slots)
        if grown is not None:
            results[grown] = replace(results[grown], kv_tokens=slots[grown].cache.capacity)
        t3 = time.perf_counter()
        self.timings.forward_s += t2 - t1
        self.timings.other_s += (t1 - t0) + (t3 - t2)
        self.timings.steps += 1
        return results

    def _rows(self, slot: Slot, item: VerifyItem) -> Rows:
        """What this step computes for one item: its chunk of pending context, then, if that
        completes the context, its root and (fitted) tree, or the root alone for its features."""
        c = min(max(item.prefill, 0), len(slot.pending))
        complete = c == len(slot.pending)
        if complete and item.decode:
            tree = self.book.fit(slot, item.tree, c)
            for rule in slot.processors:
                tree = rule.prune(tree)
            return Rows(c, tree, True, True)
        root_row = complete and c > 0 and self.features
        return Rows(c, _EMPTY, False, root_row)
