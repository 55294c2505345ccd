"""Suffix drafter (SuffixDecoding-style): continuations of the context's longest earlier match, as a
token tree scored by how often each continuation followed, over the tenant's finished outputs and
the request's own prompt and output.

Two indexes per request, searched together as one corpus:
  * the request's own text (prompt + output so far), extended as ``ctx.tokens`` grows, freed on
    ``release``;
  * its tenant's cache of finished outputs (each with the last ``max_match`` prompt tokens before it,
    so the start of an output is found from the prompt that led to it), filled on ``release``.
    Caches are per tenant (``ctx.tenant``): one tenant's outputs never shape another tenant's drafts,
    which would leak them through timing. Each is bounded: the oldest outputs go first (FIFO) when
    it holds more than ``max_requests`` outputs or ``max_tokens`` tokens.

A propose step: find the longest suffix of the context (``min_match`` ≤ m ≤ ``max_match`` tokens)
that occurred earlier; from its occurrences (the most recent ``max_occurrences``, the request's own
first) grow a tree best-first by the estimated probability of each node, count(node) ÷ occurrences
(the product of count(child) ÷ count(parent) along the path); keep nodes whose probability reaches
``min_prob``, at depth ≤ min(budget.max_depth, ``depth_factor`` · m), and at most budget.max_nodes.
A longer match is stronger evidence, so it earns a deeper tree (SuffixDecoding's max_spec_factor).

In the request's own text an occurrence close to the root continues as a periodic copy (see
``Occurrence``), so a text caught in a loop is drafted as deep as the rule allows.

Worked example: the tenant's cache holds the outputs ``a b c d`` then ``a b c e`` (another tenant's
``x a b c f`` is never seen here); the request's own text is ``x a b c`` (the root is c). The longest
match is ``a b c`` (m = 3), twice; one continues with d, one with e, each with probability 1/2: the
tree is root → e, root → d (the more recent first). Had the request's text been ``a b c a b c``,
its own earlier ``a b c`` (continuing ``a b c`` as a periodic copy) would be a third occurrence, and
come first (own text before the cache on ties).

The index (hash chains over FIFO token streams, and the longest-match scan) is
workers/drafters/suffix_index.py; this module grows the tree and keeps the per-request and
per-tenant state.
"""

from __future__ import annotations

import heapq
import itertools
from array import array
from dataclasses import dataclass
from typing import Sequence

from workers.contract import DraftContext, TreeBudget
from workers.drafters.base import Drafter
from workers.drafters.suffix_index import SEP, Found, Occurrence, Stream, TenantCache, scan
from workers.speculation.tree import TokenTree

__all__ = ["SuffixDrafter"]

# How many of the last indexed tokens must still match for a context to count as "the same request,
# grown" (as in workers/drafters/ngram.py): a full comparison would be O(context) per step.
_TAIL_CHECK = 8


def _grow(occurrences: list[Occurrence], max_nodes: int, max_depth: int, min_prob: float) -> TokenTree:
    """The tree of the occurrences' continuations, best-first by count, ≤ max_nodes, depth ≤ max_depth,
    every node followed by at least ``min_prob`` of the occurrences.

    A node's count is at most its parent's, and ties go to the node made first (by the more recent
    occurrence), so the heap emits parents before their children: a topological, best-first order.
    """
    min_count = min_prob * len(occurrences) - 1e-9
    heap: list = []
    order = itertools.count()

    def push_children(members: list[Occurrence], parent: int, depth: int) -> None:
        groups: dict[int, list[Occurrence]] = {}
        for tokens, j, period in members:
            if j < len(tokens) and tokens[j] != SEP:
                nxt = j + 1 if j + 1 < len(tokens) or not period else j + 1 - period
                groups.setdefault(tokens[j], []).append((tokens, nxt, period))
        for tok, group in groups.items():
            if len(group) >= min_count:
                heapq.heappush(heap, (-len(group), next(order), tok, parent, depth, group))

    out_tok: list[int] = []
    out_par: list[int] = []
    push_children(occurrences, -1, 1)
    while heap and len(out_tok) < max_nodes:
        _, _, tok, parent, depth, group = heapq.heappop(heap)
        out_tok.append(tok)
        out_par.append(parent)
        if depth < max_depth:
            push_children(group, len(out_tok) - 1, depth + 1)
    return TokenTree(tuple(out_tok), tuple(out_par))


@dataclass
class _RequestState:
    tenant: str
    prompt_len: int
    stream: Stream
    source: Sequence[int]  # the caller's ctx.tokens at the last propose (see release)


class SuffixDrafter(Drafter):
    """Frequency-scored continuation trees from the tenant's finished outputs and the request's own text.

    Options: ``max_match`` / ``min_match`` bound the suffix length matched; ``min_prob`` prunes
    unlikely nodes; ``depth_factor`` (α) caps the depth at α × match length; ``max_occurrences``
    bounds the occurrences a tree is grown from and ``max_scan`` the chain entries looked at per
    anchor; ``max_requests`` / ``max_tokens`` bound each tenant's cache.

    Memory: a request's index lives until ``release`` (its context is bounded by the model's); a
    tenant's cache holds ≤ max_tokens tokens + one separator per output, each costing 8 bytes, 8
    more per anchor, and ≤ 1 dict entry per anchor (~100 bytes; k-grams that repeat share one):
    ~400 bytes a token measured on text that rarely repeats, so ≤ ~40 MB at the default 100,000
    tokens. Caches are never evicted across tenants (that would let one tenant's traffic change
    another's drafts), so the total is bounded by the configured tenants × that per-tenant bound;
    ``drop_tenant`` frees a removed tenant's cache (tenants are keyed by their immutable id, so a
    tenant created again under the same name starts with an empty cache).
    """

    name = "suffix"

    def __init__(
        self,
        max_match: int = 32,
        min_match: int = 2,
        min_prob: float = 0.1,
        depth_factor: float = 1.0,
        max_occurrences: int = 64,
        max_scan: int = 256,
        max_requests: int = 1000,
        max_tokens: int = 100_000,
    ) -> None:
        if not 1 <= min_match <= max_match:
            raise ValueError(f"need 1 <= min_match <= max_match, got min_match={min_match}, max_match={max_match}")
        if not 0.0 <= min_prob <= 1.0:
            raise ValueError(f"min_prob must be in [0, 1], got {min_prob}")
        if not depth_factor > 0:
            raise ValueError(f"depth_factor must be > 0, got {depth_factor}")
        for opt, value in (("max_occurrences", max_occurrences), ("max_scan", max_scan),
                           ("max_requests", max_requests), ("max_tokens", max_tokens)):
            if value < 1:
                raise ValueError(f"{opt} must be >= 1, got {value}")
        self.max_match = max_match
        self.min_match = min_match
        self.min_prob = min_prob
        self.depth_factor = depth_factor
        self.max_occurrences = max_occurrences
        self.max_scan = max_scan
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        # Anchors min_match · 4^i: a match found on anchor k's chain is measured by binary search up
        # to max_match; longer anchors keep a long chain of a common short k-gram (only max_scan of
        # it is looked at) from hiding a long match.
        anchors = [min_match]
        while anchors[-1] * 4 <= max_match:
            anchors.append(anchors[-1] * 4)
        self.anchors = tuple(anchors)
        self._requests: dict[str, _RequestState] = {}
        self._tenants: dict[str, TenantCache] = {}
        # Removed tenants' ids: a request of theirs that finishes later adds nothing. Ids are never
        # reused, so this only grows, by one short string per removal.
        self._dropped: set[str] = set()

    def propose(self, ctx: DraftContext, budget: TreeBudget) -> TokenTree:
        state = self._state(ctx)
        if not budget.speculates:
            return TokenTree.empty()  # the index catches up on the next call that drafts
        stream = self._catch_up(state, ctx)
        tail = stream.tokens[-self.max_match :]
        found = Found(self.max_occurrences)
        scan(stream, tail, found, self.max_scan, periodic=True)
        cache = self._tenants.get(state.tenant)
        if cache is not None:
            scan(cache.stream, tail, found, self.max_scan, periodic=False)
        if found.best < self.min_match:
            return TokenTree.empty()
        depth = min(budget.max_depth, max(1, int(self.depth_factor * found.best)))
        return _grow(found.occurrences, budget.max_nodes, depth, self.min_prob)

    def release(self, request_id: str) -> None:
        """Forget the request; add its output (after its last ``max_match`` prompt tokens) to its
        tenant's cache.

        NOTE: the output is read from the ``ctx.tokens`` object of the last ``propose``. The
        BatchWorker extends that same list in place, so the cache gets every committed token; a
        caller passing copies loses only the tokens committed after its last propose.
        """
        state = self._requests.pop(request_id, None)
        if state is None:
            return
        indexed = state.stream.tokens
        source = state.source
        if len(source) < len(indexed) or _tail_changed(indexed, source):
            source = indexed
        if len(source) <= state.prompt_len or state.tenant in self._dropped:
            return  # no output, or its tenant was removed
        start = max(0, state.prompt_len - self.max_match)
        cache = self._tenants.get(state.tenant)
        if cache is None:
            cache = self._tenants[state.tenant] = TenantCache(self.anchors, self.max_requests, self.max_tokens)
        cache.add(array("q", map(int, source[start:])))

    def evict(self, request_id: str) -> None:
        """Forget a request that will come back (evicted, not finished): its output joins the
        tenant's cache only once, when it finishes."""
        self._requests.pop(request_id, None)

    def drop_tenant(self, tenant: str) -> None:
        """Free a removed tenant's cache of outputs; nothing is added for it again."""
        self._dropped.add(tenant)
        self._tenants.pop(tenant, None)

    def cached_tokens(self, tenant: str) -> int:
        """Output tokens held in `tenant`'s cache (separators not counted)."""
        cache = self._tenants.get(tenant)
        return 0 if cache is None else cache.tokens

    def _state(self, ctx: DraftContext) -> _RequestState:
        state = self._requests.get(ctx.request_id)
        if state is None or state.tenant != ctx.tenant:
            state = self._requests[ctx.request_id] = _RequestState(
                ctx.tenant, ctx.prompt_len, Stream(self.anchors), ctx.tokens)
        state.source = ctx.tokens
        state.prompt_len = ctx.prompt_len
        return state

    def _catch_up(self, state: _RequestState, ctx: DraftContext) -> Stream:
        """The request's stream, extended by the tokens appended since the last call (rebuilt if the
        context shrank or its last indexed tokens changed)."""
        stream = state.stream
        seen = len(stream.tokens)
        if len(ctx.tokens) < seen or _tail_changed(stream.tokens, ctx.tokens):
            stream = state.stream = Stream(self.anchors)
            seen = 0
        if len(ctx.tokens) > seen:
            stream.extend([int(t) for t in ctx.tokens[seen:]])
        return stream


def _tail_changed(indexed: array, tokens: Sequence[int]) -> bool:
    k = min(_TAIL_CHECK, len(indexed))
    start = len(indexed) - k
    return any(int(tokens[start + j]) != indexed[start + j] for j in range(k))
