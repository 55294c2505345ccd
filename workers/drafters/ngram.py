"""N-gram drafter: prompt lookup over the request's own text (prompt + output so far).

The longest suffix of the context that occurred earlier predicts that what followed it then follows
it now. Several earlier occurrences with different continuations become a token *tree*, best branch
first. Model-free, so it costs microseconds; it shines on copying, extraction and summarisation, and
accepts little on open chat (the speculation controller backs off there).

Per request the drafter keeps an index n-gram → positions, updated from the tokens appended since
the last call, so one ``propose`` costs O(new tokens + matches), not O(context).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Sequence

from workers.contract import DraftContext, TreeBudget
from workers.drafters.base import Drafter
from workers.speculation.tree import TokenTree

__all__ = ["NgramDrafter"]

# How many of the last indexed tokens must still match for a context to count as "the same request,
# grown": a full comparison would be O(context) per step. ctx.tokens only grows by contract; this
# catches a request id reused for different text.
_TAIL_CHECK = 8

# Match weights: one match of length n weighs as much as two of length n - 1; within that, more recent
# matches weigh slightly more (by rank), so the number of matches through a node matters most and
# recency breaks near-ties.
_RECENCY_DECAY = 0.95


@dataclass
class _RequestIndex:
    """The n-grams of one request's context.

    ``starts[g]`` lists, in increasing order, every position e with ``tokens[e - len(g):e] == g`` and
    e ≤ len(tokens) - 1 (at least one continuation token follows). N-grams of every length share the
    dict: tuples of different lengths never collide.
    """

    tokens: list[int] = field(default_factory=list)
    starts: dict[tuple[int, ...], list[int]] = field(default_factory=dict)

    def extend(self, new: Sequence[int], min_n: int, max_n: int) -> None:
        tokens, starts = self.tokens, self.starts
        first_e = max(len(tokens), 1)  # the positions e ≤ old_len - 1 are indexed already
        tokens.extend(int(t) for t in new)
        for e in range(first_e, len(tokens)):
            for n in range(min_n, min(max_n, e) + 1):
                starts.setdefault(tuple(tokens[e - n : e]), []).append(e)


class NgramDrafter(Drafter):
    """Prompt-lookup drafter proposing a tree of the continuations of earlier suffix matches.

    Options: ``max_ngram`` / ``min_ngram`` bound the suffix length tried (longest first). The registry's
    ``ngram`` uses ``min_ngram=1`` (why: workers/drafters/registry.py): one-token matches are often
    wrong on free text, but a small tree costs little and the controller shrinks it where it fails
    (scheduler/sizing.py);
    ``max_matches`` bounds how many earlier occurrences become branches.

    Worked example: context ``a b c d a b e a b`` (the root is the last ``b``), max_depth 2. No
    suffix longer than ``a b`` occurred before; ``a b`` occurred twice, followed by ``c d`` and by
    ``e a``. Both matches have n = 2; the later one weighs slightly more, so the tree is, best first,
    ``e, a, c, d`` with parents ``-1, 0, -1, 2``: root → e → a and root → c → d.
    """

    name = "ngram"

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1, max_matches: int = 8) -> None:
        if min_ngram < 1 or max_ngram < min_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}")
        if max_matches < 1:
            raise ValueError(f"max_matches must be >= 1, got {max_matches}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.max_matches = max_matches
        self._indexes: dict[str, _RequestIndex] = {}

    def propose(self, ctx: DraftContext, budget: TreeBudget) -> TokenTree:
        if not budget.speculates:
            return TokenTree.empty()  # the index catches up on the next call that drafts
        index = self._update(ctx)
        matches = self._matches(index)
        if not matches:
            return TokenTree.empty()
        return _best_first_tree(index.tokens, matches, budget)

    def observe(self, ctx: DraftContext) -> None:
        # indexing a long prompt at its first proposal would cost one step all of it: spread
        # it over its chunks' steps instead (README, "Chunked prefill")
        self._update(ctx)

    def release(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)

    def _update(self, ctx: DraftContext) -> _RequestIndex:
        """The request's index, extended by the tokens appended since the last call (rebuilt if the
        context shrank or its last indexed tokens changed)."""
        index = self._indexes.get(ctx.request_id)
        seen = 0 if index is None else len(index.tokens)
        if index is None or len(ctx.tokens) < seen or _tail_changed(index.tokens, ctx.tokens):
            index = self._indexes[ctx.request_id] = _RequestIndex()
            seen = 0
        if len(ctx.tokens) > seen:
            index.extend(ctx.tokens[seen:], self.min_ngram, self.max_ngram)
        return index

    def _matches(self, index: _RequestIndex) -> list[tuple[int, float]]:
        """Earlier occurrences of the context's suffix as (continuation start, weight), best first:
        longest n first, most recent first within one n; each position once, at its longest n."""
        tokens = index.tokens
        found: list[tuple[int, float]] = []
        seen: set[int] = set()
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            for e in reversed(index.starts.get(tuple(tokens[-n:]), ())):
                if e in seen:
                    continue  # matched already with a longer n
                seen.add(e)
                found.append((e, 2.0**n * _RECENCY_DECAY ** len(found)))
                if len(found) >= self.max_matches:
                    return found
        return found


def _tail_changed(indexed: list[int], tokens: Sequence[int]) -> bool:
    k = min(_TAIL_CHECK, len(indexed))
    start = len(indexed) - k
    return any(int(tokens[start + j]) != indexed[start + j] for j in range(k))


def _best_first_tree(tokens: list[int], matches: list[tuple[int, float]], budget: TreeBudget) -> TokenTree:
    """A trie of the matches' continuations (≤ max_depth tokens each), weighted by the matches passing
    through each node; keep the heaviest ≤ max_nodes nodes, best first.

    A node weighs at most its parent, so expanding a heap from the root emits parents before their
    children and yields a valid topological order in which ``truncate`` keeps the best nodes.
    """
    node_of: dict[tuple[int, int], int] = {}  # (trie parent, token) -> trie node; -1 = root
    trie_tok: list[int] = []
    trie_par: list[int] = []
    weight: list[float] = []
    kids: list[list[int]] = [[]]  # row convention: kids[0] = root, kids[i + 1] = trie node i
    for e, w in matches:
        parent = -1
        for tok in tokens[e : e + budget.max_depth]:
            node = node_of.get((parent, tok))
            if node is None:
                node = node_of[(parent, tok)] = len(trie_tok)
                trie_tok.append(tok)
                trie_par.append(parent)
                weight.append(0.0)
                kids.append([])
                kids[parent + 1].append(node)
            weight[node] += w
            parent = node
    # Heap of (-weight, trie id): ties go to the node made first, i.e. by the better match.
    heap = [(-weight[c], c) for c in kids[0]]
    heapq.heapify(heap)
    new_id: dict[int, int] = {}
    out_tok: list[int] = []
    out_par: list[int] = []
    while heap and len(out_tok) < budget.max_nodes:
        _, node = heapq.heappop(heap)
        new_id[node] = len(out_tok)
        out_tok.append(trie_tok[node])
        out_par.append(-1 if trie_par[node] < 0 else new_id[trie_par[node]])
        for c in kids[node + 1]:
            heapq.heappush(heap, (-weight[c], c))
    return TokenTree(tuple(out_tok), tuple(out_par))
