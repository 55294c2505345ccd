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

KV grows in blocks of `kv_block` tokens as a request runs (`KVCache.grow`), not reserved for
prompt + max_tokens at admission: a request that omits max_tokens would otherwise hold the whole
context's KV (8,192 tokens: ~377 MB in float32 for the default model) from its first step. A
request starts with room for its prompt, one block and one tree; each time a step's tree would not
fit, its KV grows by a block or by half of what it holds, whichever is more (so a long request is
copied O(log n) times, each copy a few milliseconds), never past the model's positions.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Sequence

import numpy as np
import torch

from workers.speculation.acceptance import Acceptance, accept_coupled, accept_greedy, accept_sampling, warp

from workers.contract import ContextLengthError, Prefilled, SamplingParams, StepResult, TapSpec, TokenLogprob
from workers.model.llama_forward import LlamaForward, Segment
from workers.speculation.processors import NodeProcessor, ProcessorFactory, sampling_processors
from workers.speculation.tree import TokenTree, ancestor_mask, depths, truncate
from workers.model.prefix_cache import PrefixCache
from workers.speculation.target_taps import committed_taps


_EMPTY = TokenTree.empty()
KV_BLOCK = 256             # tokens of KV a request grows by (module docstring)


@dataclass(frozen=True)
class VerifyItem:
    request_id: str
    tree: TokenTree
    prefill: int = 0          # pending context tokens to compute first (module docstring)
    decode: bool = True       # verify the root and tree if the context is then complete


@dataclass
class _Slot:
    cache: object
    root: int
    sampling: SamplingParams
    seed: int                 # with the root's position, seeds each step's RNG (see _accept)
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


@dataclass
class _Rows:
    """One item's rows in a step's packed pass: `chunk` pending context tokens, then (when the
    context completes) the root and its tree, or the root alone for its features."""
    chunk: int
    tree: TokenTree
    decode: bool              # the root and tree are verified and committed
    root_row: bool            # the root is among the rows (decoding, or for its features)


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
        (`StepResult.features`); `kv_block`: tokens of KV a request grows by (module docstring);
        `kv_pool_bytes`: the KV memory requests and the prefix cache share; the prefix cache
        gives up blocks whenever the requests' KV needs them (the planner keeps the requests'
        KV within this pool: scheduler/kv_budget.py); `processors`: builds each request's
        logit rules (workers/speculation/processors.py; default: penalties and logit_bias); `taps`: the
        target activations a feedback-memory draft reads, returned for every committed row
        (`StepResult.taps`, `Prefilled.taps`; workers/speculation/target_taps.py)."""
        if kv_block < 1:
            raise ValueError(f"kv_block must be >= 1, got {kv_block}")
        self.kv_block = kv_block
        self.kv_pool_bytes = kv_pool_bytes
        self.target = target
        self.features = features
        self.taps = taps
        self.max_tree_tokens = max_tree_tokens
        self.prefix_cache = prefix_cache     # KV of prompt prefixes seen before, per tenant id
        self.processors = processors or sampling_processors(target.vocab_size)
        self.timings = StepTimings()
        self._slots: dict[str, _Slot] = {}

    @property
    def context_limit(self) -> int:
        return self.target.max_positions

    def active(self) -> list[str]:
        return list(self._slots)

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
        if request_id in self._slots:
            raise ValueError(f"request {request_id!r} is already admitted")
        if len(token_ids) == 0:
            raise ValueError("prompt is empty: at least one token is needed")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if len(token_ids) >= self.context_limit:
            raise ContextLengthError(
                f"prompt has {len(token_ids)} tokens; the model's context is {self.context_limit} tokens")
        # Room for the prompt, a block of output (less if fewer tokens are wanted) and one tree.
        capacity = min(len(token_ids) + min(max_new_tokens, self.kv_block) + self.max_tree_tokens + 1,
                       self.context_limit)
        cache = self.target.new_cache(capacity)
        # numpy seeds must be >= 0; an unseeded request draws its own seed once, at (re-)admission.
        seed = sampling.seed % 2**64 if sampling.seed is not None else int(np.random.SeedSequence().entropy % 2**63)
        most = min(len(token_ids) + max_new_tokens + self.max_tree_tokens + 1, self.context_limit)
        slot = _Slot(cache, int(token_ids[-1]), sampling, seed, most)
        if sampling.adjusts_logits:
            output = token_ids[len(token_ids) if prompt_len is None else prompt_len:]
            slot.processors = self.processors(sampling, [int(t) for t in output])
        context = list(token_ids[:-1])
        pc = self.prefix_cache
        chain = pc.match(tenant, context) if pc is not None else []
        done = pc.restore(chain, cache) if chain else 0
        cache.length = done
        slot.pending = context[done:]
        slot.to_store = (tenant, context, chain) if pc is not None else None
        self._slots[request_id] = slot
        self._yield_pool()
        features = taps = None
        if not (defer and slot.pending):         # whole prefill, or a whole-context cache hit
            if slot.pending or self.features:
                features, taps = self._prefill_pass(slot)
            self._complete(slot)
        return Prefilled(done, features, len(slot.pending), cache.capacity, taps=taps)

    def _prefill_pass(self, slot: _Slot) -> tuple:
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

    def _complete(self, slot: _Slot) -> None:
        """The context's KV is all computed: the prefix cache keeps it for later prompts."""
        if slot.to_store is not None:
            tenant, context, chain = slot.to_store
            self.prefix_cache.store(tenant, context, slot.cache, chain)
            slot.to_store = None
            self._yield_pool()

    def _store_blocks(self, slot: _Slot) -> None:
        """Mid-prefill: the prefix cache keeps the whole blocks computed so far (a copy of a
        block or two a step, rather than of the whole context in the step that completes it)."""
        if slot.to_store is None:
            return
        tenant, context, chain = slot.to_store
        pc = self.prefix_cache
        upto = slot.cache.length // pc.block * pc.block
        if upto > len(chain) * pc.block:
            slot.to_store = (tenant, context, pc.store(tenant, context[:upto], slot.cache, chain))
            self._yield_pool()

    def pending(self, request_id: str) -> int:
        """Context tokens of an admitted request whose KV no step has computed yet."""
        return len(self._slot(request_id).pending)

    def kv_tokens(self) -> int:
        """KV slots held by every admitted request (the prefix cache's blocks not counted)."""
        return sum(slot.cache.capacity for slot in self._slots.values())

    @property
    def kv_budget_slots(self) -> int | None:
        """KV slots the pool holds (the planner's budget: scheduler/kv_budget.py); None: no pool."""
        return None if self.kv_pool_bytes is None else self.kv_pool_bytes // self.slot_bytes

    @property
    def slot_bytes(self) -> int:
        """Bytes of one KV slot: every layer's key and value for one token."""
        f = self.target
        return 2 * f.n_layers * f.n_kv_heads * f.head_dim * torch.finfo(f.kv_dtype).bits // 8

    def _yield_pool(self) -> None:
        """The prefix cache keeps only what the requests' KV leaves of the pool."""
        if self.kv_pool_bytes is not None and self.prefix_cache is not None:
            self.prefix_cache.shrink_to(self.kv_pool_bytes - self.kv_tokens() * self.slot_bytes)

    def release(self, request_id: str) -> None:
        """Forget a request and free its KV (idempotent)."""
        self._slots.pop(request_id, None)

    def drop_tenant(self, tenant: str) -> None:
        """A removed tenant (its immutable id): its prefix-cache blocks go, and none are stored
        for it again (`PrefixCache.drop_tenant`)."""
        if self.prefix_cache is not None:
            self.prefix_cache.drop_tenant(tenant)

    def verify(self, batch: Sequence[VerifyItem]) -> list[StepResult]:
        """One forward pass over the prefill chunks, roots and trees of every request in `batch`."""
        t0 = time.perf_counter()
        slots = [self._slot(item.request_id) for item in batch]
        plans = [self._rows(slot, item) for slot, item in zip(slots, batch)]
        ids, pos, segments, wanted, starts = [], [], [], [], []
        start = 0
        for slot, rp in zip(slots, plans):
            starts.append(start)
            L, c, tree = slot.cache.length, rp.chunk, rp.tree
            ids += slot.pending[:c]
            pos += range(L, L + c)
            if rp.root_row:
                ids += [slot.root, *tree.tokens]
                pos += [L + c] + [L + c + d for d in depths(tree)]
                wanted += range(start + c, start + c + 1 + len(tree))
            rows = c + (1 + len(tree) if rp.root_row else 0)
            if rows:                             # nothing for a request whose turn has not come
                segments.append(Segment(slot.cache, start, rows, _step_mask(c, tree if rp.root_row else None)))
            start += rows
        t1 = time.perf_counter()
        logits = hidden = values = None
        if segments:
            args = (torch.tensor(ids), torch.tensor(pos), segments, torch.tensor(wanted) if wanted else None)
            if self.taps is None:
                logits, hidden = self.target.forward_hidden(*args)                  # [R, V], [R, H]
            else:
                logits, hidden, values = self.target.forward_taps(*args, self.taps.layers)   # [T, S, H]
        t2 = time.perf_counter()
        results = []
        greedy_rows = (self.target.argmax(logits) if any(s.sampling.greedy and rp.decode
                                                         for s, rp in zip(slots, plans)) else None)
        lo = 0                                   # this item's first row among the logits rows
        for item, slot, rp, first in zip(batch, slots, plans, starts):
            c, tree = rp.chunk, rp.tree
            features = logprobs = None
            length = slot.cache.length
            if rp.decode:
                acc = self._accept(slot, tree, lo, logits, greedy_rows, slot.cache.length + c)
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
                    self._store_blocks(slot)
                else:
                    self._complete(slot)
            if rp.root_row:
                lo += 1 + len(tree)
            results.append(StepResult(item.request_id, tokens, accepted, drafted, features=features,
                                      prefilled=c, pending=len(slot.pending),
                                      kv_tokens=slot.cache.capacity, logprobs=logprobs, taps=taps))
        grown = self._grow_ahead(slots)
        if grown is not None:
            results[grown] = replace(results[grown], kv_tokens=slots[grown].cache.capacity)
        t3 = time.perf_counter()
        self.timings.forward_s += t2 - t1
        self.timings.other_s += (t1 - t0) + (t3 - t2)
        self.timings.steps += 1
        return results

    def _rows(self, slot: _Slot, item: VerifyItem) -> _Rows:
        """What this step computes for one item: its chunk of pending context, then, if that
        completes the context, its root and (fitted) tree, or the root alone for its features."""
        c = min(max(item.prefill, 0), len(slot.pending))
        complete = c == len(slot.pending)
        if complete and item.decode:
            tree = self._fit(slot, item.tree, c)
            for rule in slot.processors:
                tree = rule.prune(tree)
            return _Rows(c, tree, True, True)
        root_row = complete and c > 0 and self.features
        return _Rows(c, _EMPTY, False, root_row)

    def _slot(self, request_id: str) -> _Slot:
        try:
            return self._slots[request_id]
        except KeyError:
            raise KeyError(f"request {request_id!r} was not prefilled (or was released)") from None

    def _grow_ahead(self, slots: Sequence[_Slot]) -> int | None:
        """Grow, at most, the one request of this step nearest to needing it, once it is within
        half a block of the room a full tree takes. Requests that run in step (equal lengths,
        equal pace) would otherwise all grow in one step, each grow a copy into fresh memory
        (mostly page faults): that step stalled every stream (README, "Chunked prefill").
        Only with room in the KV pool. Returns its index."""
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

    def _grown(self, slot: _Slot, wanted: int = 0) -> int:
        """The capacity a request's KV grows to: by a block or by half of what it holds,
        whichever is more (at least `wanted`), never past the model's positions."""
        cache = slot.cache
        return min(slot.max_positions, max(wanted, cache.capacity + max(self.kv_block, cache.capacity // 2)))

    def _grow(self, slot: _Slot, capacity: int) -> None:
        slot.cache.grow(capacity)
        self._yield_pool()

    def _fit(self, slot: _Slot, tree: TokenTree, chunk: int = 0) -> TokenTree:
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

    def _accept(self, slot: _Slot, tree: TokenTree, lo: int, logits: torch.Tensor,
                greedy_rows: list[int] | None, root_pos: int) -> Acceptance:
        """Acceptance of the tree whose root's logits are row `lo` of the step's logits rows."""
        n = 1 + len(tree)
        rows = logits[lo: lo + n]                                                   # [n, V]
        if slot.processors:
            # every row judged from its own path (workers/speculation/processors.py), in float32 so a
            # bias or penalty is not rounded away in a bf16 logit
            rows = rows.to(torch.float32, copy=True)
            for rule in slot.processors:
                rule.adjust(rows, tree)
            if slot.sampling.greedy:
                return accept_greedy(tree, self.target.argmax(rows))
        if slot.sampling.greedy:
            return accept_greedy(tree, greedy_rows[lo: lo + n])

        def target_probs(row: int) -> np.ndarray:
            return warp(rows[row].double().cpu().numpy(), slot.sampling)   # [V] on the host

        if slot.sampling.seed is not None:
            # A seeded request: one uniform per (seed, absolute position), and the coupled rule,
            # so its text depends on its seed alone: the same with any drafts, tree, batch, after an
            # eviction or a restart (positions never repeat, so the draws stay independent)
            return accept_coupled(tree, target_probs,
                                  lambda depth: np.random.default_rng([slot.seed, root_pos + depth]).random())
        # Unseeded: SpecInfer's rule (it accepts drafts sampled from a draft model more often),
        # with one RNG per (seed drawn at admission, position)
        rng = np.random.default_rng([slot.seed, root_pos])
        return accept_sampling(tree, target_probs, rng)


def committed_logprobs(rows: torch.Tensor, acc: Acceptance, k: int) -> tuple[TokenLogprob, ...]:
    """Each committed token's log-probability, and the `k` likeliest tokens at its position, from
    one tree's logits rows [1 + n, V] (row 0 = the root): committed token j was predicted by the
    root's row for j = 0, else by the row of the j-th accepted node, `acc.path[j - 1] + 1`.

    Read from the RAW rows, before penalties, logit_bias or a grammar change them (vLLM's default
    too): what the model itself thinks of the text, so a client can score it. The rows are the
    verification pass's own: nothing runs again.

    Example: tree (a, b) as a chain, both accepted, bonus c -> a from row 0, b from row 1, c from
    row 2.
    """
    picked = rows[[0, *(p + 1 for p in acc.path)]].to(torch.float32)            # [tau, V]
    logp = torch.log_softmax(picked, dim=-1)                                    # [tau, V]
    chosen = logp[torch.arange(len(acc.tokens)), torch.tensor(acc.tokens)].tolist()   # [tau]
    if k:
        top_v, top_i = torch.topk(logp, k, dim=-1)                              # [tau, k]
        tops = [tuple(zip(i, v)) for i, v in zip(top_i.tolist(), top_v.tolist())]
    else:
        tops = [()] * len(chosen)
    return tuple((lp, top) for lp, top in zip(chosen, tops))


def _step_mask(chunk: int, tree: TokenTree | None) -> torch.Tensor:
    """Additive mask among one item's rows: `chunk` context rows (causal), then, when `tree` is
    given, the root and its nodes (`_tree_mask`), which see every chunk row and nothing later.
    [chunk + (1 + nodes), same]."""
    if chunk == 0:
        return _tree_mask(tree) if tree is not None else torch.zeros(0, 0)
    causal = torch.full((chunk, chunk), float("-inf")).triu(1)
    if tree is None:
        return causal
    m = 1 + len(tree)
    top = torch.cat([causal, torch.full((chunk, m), float("-inf"))], dim=1)    # [chunk, chunk + m]
    bottom = torch.cat([torch.zeros(m, chunk), _tree_mask(tree)], dim=1)         # [m, chunk + m]
    return torch.cat([top, bottom])


def _tree_mask(tree: TokenTree) -> torch.Tensor:
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
