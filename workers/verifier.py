"""The verifier: one forward pass of the target checks the token trees of every request in a batch.

Per request it keeps a preallocated KV cache holding every committed token except the root (the
last committed token). A step feeds, for each request, the root followed by its tree nodes:

    row 0      = the root, at position L (L = committed KV length)
    row i + 1  = tree node i, at position L + depth(i), seeing the context, the root and its ancestors

The logits at row r predict the token after row r, so row 0 checks the root's children and the
bonus comes from the deepest accepted row. After acceptance the root and the accepted nodes' KV are
kept in place (`KVCache.commit`), the rest is forgotten, and the bonus token becomes the new root.

KV grows in blocks of `kv_block` tokens as a request runs (`KVCache.grow`), not reserved for
prompt + max_tokens at admission: a request that omits max_tokens would otherwise hold the whole
context's KV (8,192 tokens: ~377 MB in float32 for the default model) from its first step. A
request starts with room for its prompt, one block and one tree; each time a step's tree would not
fit, its KV grows by a block or by half of what it holds, whichever is more (so a long request is
copied O(log n) times, each copy a few milliseconds), never past the model's positions.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from workers.acceptance import Acceptance, accept_greedy, accept_sampling, warp

from workers.contract import ContextLengthError, Prefilled, SamplingParams, StepResult
from workers.llama_forward import LlamaForward, Segment
from workers.tree import TokenTree, ancestor_mask, depths, truncate
from workers.prefix_cache import PrefixCache


KV_BLOCK = 256             # tokens of KV a request grows by (module docstring)


@dataclass(frozen=True)
class VerifyItem:
    request_id: str
    tree: TokenTree


@dataclass
class _Slot:
    cache: object
    root: int
    sampling: SamplingParams
    seed: int                 # with the root's position, seeds each step's RNG (see _accept)
    max_positions: int


@dataclass
class StepTimings:
    """Where a step's wall time went, accumulated over steps (seconds)."""
    forward_s: float = 0.0
    other_s: float = 0.0
    steps: int = 0


class Verifier:
    def __init__(self, target: LlamaForward, *, max_tree_tokens: int = 64,
                 prefix_cache: PrefixCache | None = None, features: bool = False,
                 kv_block: int = KV_BLOCK):
        """`features`: report each request's hidden state with its step result
        (`StepResult.features`); `kv_block`: tokens of KV a request grows by (module docstring)."""
        if kv_block < 1:
            raise ValueError(f"kv_block must be >= 1, got {kv_block}")
        self.kv_block = kv_block
        self.target = target
        self.features = features
        self.max_tree_tokens = max_tree_tokens
        self.prefix_cache = prefix_cache     # KV of prompt prefixes seen before, per tenant
        self.timings = StepTimings()
        self._slots: dict[str, _Slot] = {}

    @property
    def context_limit(self) -> int:
        return self.target.max_positions

    def active(self) -> list[str]:
        return list(self._slots)

    def prefill(self, request_id: str, token_ids: Sequence[int], sampling: SamplingParams,
                max_new_tokens: int, tenant: str = "default") -> Prefilled:
        """Admit a request: compute the KV of every token but the last, which becomes the root.

        `token_ids` is the prompt, or prompt + committed output when a request is re-admitted
        (restart recovery re-prefills, it never replays steps). With a prefix cache, the KV of
        the longest prefix this tenant sent before is copied in and only the rest is computed.
        Returns how many tokens' KV came from the prefix cache, and with `features` the root's
        hidden state: the root then rides along in the same pass (its KV is written past the
        context and overwritten by the first step), so a predictor has it before any step.
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
        slot = _Slot(cache, int(token_ids[-1]), sampling, seed, self.context_limit)
        context = list(token_ids[:-1])
        pc = self.prefix_cache
        chain = pc.match(tenant, context) if pc is not None else []
        done = pc.restore(chain, cache) if chain else 0
        rows = list(context[done:]) + ([slot.root] if self.features else [])
        features = None
        if rows:
            n = len(rows)
            causal = torch.full((n, n), float("-inf")).triu(1)
            wanted = torch.tensor([n - 1]) if self.features else None
            _, hidden = self.target.forward_hidden(torch.tensor(rows), torch.arange(done, done + n),
                                                   [Segment(cache, 0, n, causal)], wanted)  # [1, H]
            cache.length = len(context)
            if hidden is not None:
                features = tuple(hidden[0].float().tolist())
        if pc is not None:
            pc.store(tenant, context, cache, chain)
        self._slots[request_id] = slot
        return Prefilled(done, features)

    def release(self, request_id: str) -> None:
        """Forget a request and free its KV (idempotent)."""
        self._slots.pop(request_id, None)

    def verify(self, batch: Sequence[VerifyItem]) -> list[StepResult]:
        """One forward pass over the roots and trees of every request in `batch`."""
        t0 = time.perf_counter()
        slots = [self._slot(item.request_id) for item in batch]
        trees = [self._fit(slot, item.tree) for slot, item in zip(slots, batch)]
        ids, pos, segments = [], [], []
        start = 0
        for slot, tree in zip(slots, trees):
            rows = 1 + len(tree)
            ids += [slot.root, *tree.tokens]
            L = slot.cache.length
            pos += [L] + [L + d for d in depths(tree)]
            segments.append(Segment(slot.cache, start, rows, _tree_mask(tree)))
            start += rows
        ids_t, pos_t = torch.tensor(ids), torch.tensor(pos)
        t1 = time.perf_counter()
        logits, hidden = self.target.forward_hidden(ids_t, pos_t, segments, torch.arange(start))  # [T, V], [T, H]
        t2 = time.perf_counter()
        results = []
        greedy_rows = self.target.argmax(logits) if any(s.sampling.greedy for s in slots) else None
        for item, slot, tree, seg in zip(batch, slots, trees, segments):
            acc = self._accept(slot, tree, seg, logits, greedy_rows)
            slot.cache.commit(1, list(acc.path))
            slot.root = acc.tokens[-1]
            results.append(StepResult(item.request_id, acc.tokens, acc.accepted, len(tree),
                                      features=self._features(hidden, seg, acc)))
        t3 = time.perf_counter()
        self.timings.forward_s += t2 - t1
        self.timings.other_s += (t1 - t0) + (t3 - t2)
        self.timings.steps += 1
        return results

    def _features(self, hidden: torch.Tensor, seg: Segment, acc: Acceptance) -> tuple[float, ...] | None:
        """The hidden state of the row whose logits gave the bonus token: row 0 (the root) when
        nothing was accepted, else the deepest accepted node's row."""
        if not self.features:
            return None
        row = seg.start + (acc.path[-1] + 1 if acc.path else 0)
        return tuple(hidden[row].float().tolist())

    def _slot(self, request_id: str) -> _Slot:
        try:
            return self._slots[request_id]
        except KeyError:
            raise KeyError(f"request {request_id!r} was not prefilled (or was released)") from None

    def _fit(self, slot: _Slot, tree: TokenTree) -> TokenTree:
        # The root takes one KV slot and one position; the tree gets what is left of both.
        cache = slot.cache
        wanted = cache.length + 1 + min(len(tree), self.max_tree_tokens)
        if wanted > cache.capacity and cache.capacity < slot.max_positions:
            step = max(self.kv_block, cache.capacity // 2)
            cache.grow(min(slot.max_positions, max(wanted, cache.capacity + step)))
        room = min(cache.capacity, slot.max_positions) - cache.length - 1
        max_nodes = min(self.max_tree_tokens, room)
        if len(tree) <= max_nodes and (len(tree) == 0 or max(depths(tree)) <= room):
            return tree
        return truncate(tree, max(max_nodes, 0), max(room, 0))

    def _accept(self, slot: _Slot, tree: TokenTree, seg: Segment, logits: torch.Tensor,
                greedy_rows: list[int] | None) -> Acceptance:
        lo = seg.start
        if slot.sampling.greedy:
            return accept_greedy(tree, greedy_rows[lo: lo + seg.rows])
        rows = logits[lo: lo + seg.rows]

        def target_probs(row: int) -> np.ndarray:
            return warp(rows[row].double().numpy(), slot.sampling)

        # One RNG per (seed, position): a request's draws depend on where it is in its output, not
        # on how it got there, so its sampled text is the same alone, batched, after being evicted
        # and re-prefilled, or after a restart (positions never repeat, so draws stay independent).
        rng = np.random.default_rng([slot.seed, slot.cache.length])
        return accept_sampling(tree, target_probs, rng)


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
