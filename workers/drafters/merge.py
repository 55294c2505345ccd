"""Merge drafter: several drafters' trees as one (SpecInfer's merge), each node remembering who proposed it.

``MergeDrafter([ngram, suffix])`` (registry name ``merge:ngram+suffix``) asks every drafter for a tree
under the whole budget, then keeps a fair share of each drafter's best nodes and merges them with
``workers.speculation.tree.merge``: a continuation several drafters propose is stored once.

Budget rule: the drafters take turns, round-robin in the order named, each adding its next node in
its own best-first order, until ``max_nodes`` distinct nodes are kept. A node another drafter already
added costs nothing, and a drafter that runs out of nodes leaves its turns to the others; so when all
propose enough, each gets ⌈max_nodes ÷ n⌉ (or ⌊·⌋) new nodes, and none is wasted on a duplicate.
Depth is not split: every node stays at depth ≤ ``max_depth``.

Draft probabilities: a node keeps the ``draft_probs`` entry (q) of the first drafter, in name order,
whose kept nodes hold it (``merge``'s rule); ``None`` = one-hot, what deterministic drafters such as
ngram and suffix give. NOTE: merging a sampled drafter with another one makes multi-step speculative
sampling inexact unless their draws are independent with disjoint supports (see
``workers.speculation.acceptance.accept_sampling``); merged deterministic drafters are exact.

Worked example, budget 3 nodes: ngram proposes root → a → b → c, suffix proposes root → a → d and
root → e. Turns: ngram a (new), suffix a (shared, free), ngram b (new), suffix d (new): 3 nodes, so
the merged tree is root → a → {b, d}, with proposers ((ngram, suffix), (ngram,), (suffix,)).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from workers.drafters.base import Drafter

from workers.contract import DraftContext, TreeBudget
from workers.speculation.tree import TokenTree, merge, truncate

__all__ = ["MergedTree", "MergeDrafter", "merge_proposals"]


@dataclass(frozen=True)
class MergedTree:
    """A merged tree and, per node, the names of the drafters whose tree held it (in drafter order).

    Kept beside the tree, so ``TokenTree`` stays plain data; ``proposers[i]`` belongs to node i.
    """

    tree: TokenTree
    proposers: tuple[tuple[str, ...], ...]

    def __post_init__(self) -> None:
        if len(self.proposers) != len(self.tree):
            raise ValueError(f"MergedTree: {len(self.tree)} nodes but {len(self.proposers)} proposer entries")


def merge_proposals(proposals: Sequence[tuple[str, TokenTree]], budget: TreeBudget) -> MergedTree:
    """Merge named trees under ``budget`` by the round-robin rule in this module's docstring.

    >>> a = TokenTree.chain([1, 2, 3])                 # root → 1 → 2 → 3
    >>> b = TokenTree((1, 4, 5), (-1, 0, -1))          # root → 1 → 4, root → 5
    >>> m = merge_proposals([("a", a), ("b", b)], TreeBudget(3, 8))
    >>> m.tree, m.proposers
    (TokenTree(tokens=(1, 2, 4), parents=(-1, 0, 0)), (('a', 'b'), ('a',), ('b',)))
    """
    names = [name for name, _ in proposals]
    if len(set(names)) != len(names):
        raise ValueError(f"merge_proposals: drafter names must be distinct, got {names}")
    trees = [truncate(tree, budget.max_nodes, budget.max_depth) for _, tree in proposals]
    kept = _round_robin(trees, budget.max_nodes)
    merged = merge([truncate(tree, k, budget.max_depth) for tree, k in zip(trees, kept)])
    return MergedTree(merged, _proposers(merged, names, trees))


def _round_robin(trees: Sequence[TokenTree], max_nodes: int) -> list[int]:
    """How many of each tree's first nodes to keep: turns in tree order, one node per turn, a node
    already kept (same path from the root) free, until ``max_nodes`` distinct nodes are kept."""
    ids: dict[tuple[int, int], int] = {}  # (parent's id, token) -> id of the path from the root
    node_ids: list[list[int]] = [[] for _ in trees]
    chosen: set[int] = set()
    kept = [0] * len(trees)
    for r in range(max((len(t) for t in trees), default=0)):
        for t, tree in enumerate(trees):
            if r >= len(tree) or kept[t] < r:
                continue  # out of nodes, or stopped by the budget
            par = tree.parents[r]
            node = ids.setdefault((node_ids[t][par] if par >= 0 else -1, tree.tokens[r]), len(ids))
            node_ids[t].append(node)
            if node not in chosen:
                if len(chosen) >= max_nodes:
                    continue
                chosen.add(node)
            kept[t] = r + 1
    return kept


def _proposers(merged: TokenTree, names: Sequence[str], trees: Sequence[TokenTree]) -> tuple[tuple[str, ...], ...]:
    """Per merged node, the drafters whose (budget-cut) tree holds it, even past their kept share."""
    where = {(par, tok): i for i, (tok, par) in enumerate(zip(merged.tokens, merged.parents))}
    found: list[list[str]] = [[] for _ in range(len(merged))]
    for name, tree in zip(names, trees):
        remap: list[int] = []  # this tree's node -> merged node, -2 = not in the merged tree
        for tok, par in zip(tree.tokens, tree.parents):
            parent = remap[par] if par >= 0 else -1
            node = -2 if parent == -2 else where.get((parent, tok), -2)
            remap.append(node)
            if node >= 0:
                found[node].append(name)
    return tuple(tuple(f) for f in found)


class MergeDrafter(Drafter):
    """Runs several drafters and merges their trees (see the module docstring for the budget rule)."""

    def __init__(self, drafters: Sequence[Drafter], name: str | None = None) -> None:
        if len(drafters) < 2:
            raise ValueError(f"a merge needs at least 2 drafters, got {len(drafters)}")
        names = [d.name for d in drafters]
        if len(set(names)) != len(names):
            raise ValueError(f"merged drafters must have distinct names, got {names}")
        self.drafters = tuple(drafters)
        self.name = name or "merge:" + "+".join(names)
        # the target activations its parts read (one memory draft per merge: the first one's)
        self.target_taps = next((d.target_taps for d in drafters if d.target_taps is not None), None)

    def propose_merged(self, ctx: DraftContext, budget: TreeBudget) -> MergedTree:
        """The merged tree with its proposers (for per-drafter statistics). Every drafter sees every
        call, even one that may not speculate: it may keep per-request state (see SuffixDrafter)."""
        trees = []
        self.catch_up_s = 0.0
        for d in self.drafters:
            trees.append((d.name, d.propose(ctx, budget)))
            self.catch_up_s += d.catch_up_s
        return merge_proposals(trees, budget)

    def propose_batch(self, items):
        """One `propose` per request, the parts' one-off seconds summed over them."""
        out, one_off = [], 0.0
        for ctx, budget in items:
            out.append(self.propose(ctx, budget))
            one_off += self.catch_up_s
        self.catch_up_s = one_off
        return out

    def propose(self, ctx: DraftContext, budget: TreeBudget) -> TokenTree:
        return self.propose_merged(ctx, budget).tree

    def release(self, request_id: str) -> None:
        for d in self.drafters:
            d.release(request_id)

    def evict(self, request_id: str) -> None:
        for d in self.drafters:
            d.evict(request_id)

    def drop_tenant(self, tenant: str) -> None:
        for d in self.drafters:
            d.drop_tenant(tenant)
