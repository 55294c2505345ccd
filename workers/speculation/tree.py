"""Token trees as plain data, and the pure functions the verifier and the acceptance rules need.

A token tree holds candidate continuations of one request with shared prefixes stored once. The
**root** is the request's last committed token; it is *not* a node of the tree. Node ``i`` has token
``tokens[i]`` and parent ``parents[i]`` (``-1`` = a child of the root). Nodes are in topological
order (``parents[i] < i``), so one forward sweep over the nodes sees every parent before its
children, which is what keeps every function here a single loop.

Row convention (used by ``children``, the verifier and the acceptance rules): **row 0 is the root,
row i + 1 is node i**. The verifier returns one target output per row (the target's prediction
*after* that row's token), so row 0's output predicts the root's children and row ``i + 1``'s output
predicts node ``i``'s children.

Example, drafts "the cat" and "the dog" and "a" after the root::

    root ─┬─ 0:"the" ─┬─ 1:"cat"
          │           └─ 2:"dog"
          └─ 3:"a"

    TokenTree(tokens=(the, cat, dog, a), parents=(-1, 0, 0, -1))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import numpy as np

__all__ = [
    "TokenTree",
    "depths",
    "ancestor_mask",
    "children",
    "leaf_paths",
    "merge",
    "truncate",
    "row_paths",
    "keep",
]


@dataclass(frozen=True, eq=False, repr=False)
class TokenTree:
    """Candidate continuations under the root (the last committed token).

    ``draft_probs[i]`` is the drafter's distribution q over the vocabulary *at node i's parent row*,
    the one node i's token was drawn from. ``None`` (for the whole field or for one entry) means a
    deterministic drafter: q is one-hot at ``tokens[i]``. A field whose entries are all ``None`` is
    stored as ``None`` so that equal trees compare equal.

    >>> t = TokenTree(tokens=(5, 7, 9), parents=(-1, 0, -1))
    >>> len(t), t.tokens, t.parents
    (3, (5, 7, 9), (-1, 0, -1))
    >>> TokenTree.chain([5, 7]) == TokenTree((5, 7), (-1, 0))
    True
    """

    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    draft_probs: Optional[tuple[Optional[np.ndarray], ...]] = None

    def __post_init__(self) -> None:
        # Coerce so callers may pass lists or numpy ints; a frozen dataclass needs object.__setattr__.
        tokens = tuple(int(t) for t in self.tokens)
        parents = tuple(int(p) for p in self.parents)
        object.__setattr__(self, "tokens", tokens)
        object.__setattr__(self, "parents", parents)
        n = len(tokens)
        if len(parents) != n:
            raise ValueError(f"TokenTree: {n} tokens but {len(parents)} parents")
        seen: set[tuple[int, int]] = set()
        for i, (tok, par) in enumerate(zip(tokens, parents)):
            if not -1 <= par < i:
                raise ValueError(
                    f"TokenTree: parents[{i}] = {par}; it must be in [-1, {i}) "
                    "(-1 = child of the root; nodes in topological order)"
                )
            if (par, tok) in seen:
                raise ValueError(
                    f"TokenTree: node {i} repeats token {tok} under parent {par}; "
                    "siblings must have distinct tokens (merge shared prefixes)"
                )
            seen.add((par, tok))
        if self.draft_probs is not None:
            probs = tuple(self.draft_probs)
            if len(probs) != n:
                raise ValueError(f"TokenTree: {n} tokens but {len(probs)} draft_probs")
            for i, q in enumerate(probs):
                if q is not None and (not isinstance(q, np.ndarray) or q.ndim != 1):
                    raise ValueError(f"TokenTree: draft_probs[{i}] must be None or a 1-D numpy array")
            object.__setattr__(self, "draft_probs", None if all(q is None for q in probs) else probs)

    @classmethod
    def empty(cls) -> "TokenTree":
        """No speculation: a step over the empty tree commits just the bonus token."""
        return cls((), ())

    @classmethod
    def chain(
        cls, tokens: Iterable[int], draft_probs: Optional[Sequence[Optional[np.ndarray]]] = None
    ) -> "TokenTree":
        """A single branch: ``chain([a, b, c])`` is root → a → b → c (parents -1, 0, 1)."""
        toks = tuple(tokens)
        return cls(toks, tuple(range(-1, len(toks) - 1)), None if draft_probs is None else tuple(draft_probs))

    def __len__(self) -> int:
        return len(self.tokens)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TokenTree):
            return NotImplemented
        if self.tokens != other.tokens or self.parents != other.parents:
            return False
        a, b = self.draft_probs, other.draft_probs
        if a is None or b is None:
            return a is b
        return all(
            (x is None and y is None) or (x is not None and y is not None and np.array_equal(x, y))
            for x, y in zip(a, b)
        )

    def __hash__(self) -> int:
        return hash((self.tokens, self.parents))

    def __repr__(self) -> str:
        probs = "" if self.draft_probs is None else f", draft_probs=<{len(self.draft_probs)} entries>"
        return f"TokenTree(tokens={self.tokens}, parents={self.parents}{probs})"


def depths(tree: TokenTree) -> list[int]:
    """Depth of every node; children of the root have depth 1 (the root itself would be 0).

    The verifier's position for node i is ``committed_len - 1 + depths[i]`` (the root sits at
    ``committed_len - 1``).

    >>> depths(TokenTree((1, 2, 3, 4), (-1, 0, 0, -1)))
    [1, 2, 2, 1]
    """
    out: list[int] = []
    for p in tree.parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


def ancestor_mask(tree: TokenTree) -> np.ndarray:
    """``[n, n]`` bool: row i is true at j iff j == i or node j is an ancestor of node i.

    This is the tree part of the verifier's attention mask (every node also sees the committed
    context). Row i = own identity OR its parent's row, one pass thanks to topological order.

    >>> ancestor_mask(TokenTree((1, 2, 3), (-1, 0, -1))).astype(int)
    array([[1, 0, 0],
           [1, 1, 0],
           [0, 0, 1]])
    """
    n = len(tree)
    mask = np.zeros((n, n), dtype=bool)  # [n, n]
    for i, p in enumerate(tree.parents):
        if p >= 0:
            mask[i, : p + 1] = mask[p, : p + 1]  # ancestors of p all have index < p + 1
        mask[i, i] = True
    return mask


def children(tree: TokenTree) -> list[list[int]]:
    """Children of every row: index 0 = the root's children, index i + 1 = node i's children.

    >>> children(TokenTree((1, 2, 3), (-1, 0, -1)))
    [[0, 2], [1], [], []]
    """
    out: list[list[int]] = [[] for _ in range(len(tree) + 1)]
    for i, p in enumerate(tree.parents):
        out[p + 1].append(i)
    return out


def leaf_paths(tree: TokenTree) -> list[list[int]]:
    """Root-to-leaf paths as node indices, one per leaf, in leaf index order (empty tree → ``[]``).

    >>> leaf_paths(TokenTree((1, 2, 3, 4), (-1, 0, 0, -1)))
    [[0, 1], [0, 2], [3]]
    """
    n = len(tree)
    has_child = [False] * n
    for p in tree.parents:
        if p >= 0:
            has_child[p] = True
    paths = []
    for leaf in range(n):
        if has_child[leaf]:
            continue
        path, node = [], leaf
        while node >= 0:
            path.append(node)
            node = tree.parents[node]
        paths.append(path[::-1])
    return paths


def merge(trees: Sequence[TokenTree]) -> TokenTree:
    """One tree holding every branch of ``trees``; shared prefixes are stored once.

    The same token under the same (merged) parent is the same node. Nodes keep the order they are
    first met (trees in order, nodes in order), so the result is topological and the first tree's
    best-first order is kept. A merged node keeps the first tree's ``draft_probs`` entry.

    >>> a = TokenTree.chain([1, 2])           # root → 1 → 2
    >>> b = TokenTree((1, 3, 4), (-1, 0, -1))  # root → 1 → 3, root → 4
    >>> merge([a, b])
    TokenTree(tokens=(1, 2, 3, 4), parents=(-1, 0, 0, -1))
    """
    index: dict[tuple[int, int], int] = {}  # (merged parent, token) -> merged node
    tokens: list[int] = []
    parents: list[int] = []
    probs: list[Optional[np.ndarray]] = []
    for tree in trees:
        remap: list[int] = []  # this tree's node -> merged node
        for i, (tok, par) in enumerate(zip(tree.tokens, tree.parents)):
            key = (remap[par] if par >= 0 else -1, tok)
            node = index.get(key)
            if node is None:
                node = index[key] = len(tokens)
                tokens.append(tok)
                parents.append(key[0])
                probs.append(None if tree.draft_probs is None else tree.draft_probs[i])
            remap.append(node)
    return TokenTree(tuple(tokens), tuple(parents), tuple(probs))


def truncate(tree: TokenTree, max_nodes: int, max_depth: int) -> TokenTree:
    """The sub-tree of at most ``max_nodes`` nodes of depth ≤ ``max_depth``, preferring low indices.

    Drafters put their best nodes first, so keeping nodes in index order (a node only if its parent
    is kept) keeps the best connected sub-tree. Parents are re-indexed.

    >>> t = TokenTree((1, 2, 3, 4), (-1, 0, 1, -1))  # root → 1 → 2 → 3, root → 4
    >>> truncate(t, max_nodes=3, max_depth=2)
    TokenTree(tokens=(1, 2, 4), parents=(-1, 0, -1))
    """
    if max_nodes >= len(tree) and max_depth >= len(tree):
        return tree  # nothing can exceed either bound
    remap = [-1] * len(tree)  # old node -> new node, -1 = dropped
    depth = [0] * len(tree)
    kept: list[int] = []
    for i, p in enumerate(tree.parents):
        if len(kept) >= max_nodes:
            break
        if p >= 0 and remap[p] < 0:
            continue  # parent dropped
        depth[i] = 1 if p < 0 else depth[p] + 1
        if depth[i] > max_depth:
            continue
        remap[i] = len(kept)
        kept.append(i)
    return _subtree(tree, kept, remap)


def row_paths(tree: TokenTree) -> list[tuple[int, ...]]:
    """The tokens below the root on every row's path: row 0 (the root) has none, row i + 1 has
    node i's ancestors then node i. What a rule that depends on the text so far (a penalty, a
    grammar) reads to judge a row as if decoding had reached it.

    >>> row_paths(TokenTree((1, 2, 3), (-1, 0, -1)))
    [(), (1,), (1, 2), (3,)]
    """
    out: list[tuple[int, ...]] = [()]
    for tok, par in zip(tree.tokens, tree.parents):
        out.append(out[par + 1] + (tok,))
    return out


def keep(tree: TokenTree, allowed: Sequence[bool]) -> TokenTree:
    """The sub-tree of the nodes that are allowed and whose ancestors all are (a node a rule
    forbids takes its descendants with it). Parents are re-indexed; order is kept.

    >>> keep(TokenTree((1, 2, 3, 4), (-1, 0, 1, -1)), [True, False, True, True])
    TokenTree(tokens=(1, 4), parents=(-1, -1))
    """
    if all(allowed):
        return tree
    remap = [-1] * len(tree)
    kept: list[int] = []
    for i, p in enumerate(tree.parents):
        if allowed[i] and (p < 0 or remap[p] >= 0):
            remap[i] = len(kept)
            kept.append(i)
    return _subtree(tree, kept, remap)


def _subtree(tree: TokenTree, kept: list[int], remap: list[int]) -> TokenTree:
    """The nodes `kept` (old indices, in order; each one's parent kept too) as a tree of their
    own; `remap`: old index -> new index."""
    return TokenTree(
        tuple(tree.tokens[i] for i in kept),
        tuple(remap[tree.parents[i]] if tree.parents[i] >= 0 else -1 for i in kept),
        None if tree.draft_probs is None else tuple(tree.draft_probs[i] for i in kept),
    )
