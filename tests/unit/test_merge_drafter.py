"""Merge drafter: every proposed path once, shared prefixes once, proposers per node, the round-robin
budget rule, draft probabilities travelling with their node, and the ``merge:`` registry syntax."""

import doctest

import numpy as np
import pytest

import workers.drafters.merge
from workers.drafters.base import Drafter
from workers.contract import NO_SPECULATION, DraftContext, TreeBudget
from workers.drafters.merge import MergeDrafter, MergedTree, merge_proposals
from workers.drafters.ngram import NgramDrafter
from workers.drafters.registry import Registry, create_drafter, drafter_names, is_drafter_name
from workers.drafters.suffix import SuffixDrafter
from workers.speculation.tree import TokenTree, depths, truncate


class Fixed(Drafter):
    """Proposes the same tree every time (cut to the budget, as a drafter must); records calls."""

    def __init__(self, name, tree):
        self.name = name
        self.tree = tree
        self.budgets = []
        self.released = []

    def propose(self, ctx, budget):
        self.budgets.append(budget)
        return truncate(self.tree, budget.max_nodes, budget.max_depth)

    def release(self, request_id):
        self.released.append(request_id)


CTX = DraftContext("r", "A", [1, 2, 3], 3)


def paths(tree):
    out = []
    for tok, par in zip(tree.tokens, tree.parents):
        out.append((out[par] if par >= 0 else ()) + (tok,))
    return out


def random_tree(rng, vocab=4, max_nodes=10):
    tokens, parents, seen = [], [], set()
    for _ in range(int(rng.integers(0, max_nodes + 1))):
        par = int(rng.integers(-1, len(tokens)))
        tok = int(rng.integers(0, vocab))
        if (par, tok) not in seen:
            seen.add((par, tok))
            tokens.append(tok)
            parents.append(par)
    return TokenTree(tuple(tokens), tuple(parents))


def test_doctests():
    result = doctest.testmod(workers.drafters.merge)
    assert result.attempted > 0 and result.failed == 0


def test_docstring_example():
    a, b, c, d, e = 1, 2, 3, 4, 5
    m = merge_proposals([("ngram", TokenTree.chain([a, b, c])), ("suffix", TokenTree((a, d, e), (-1, 0, -1)))],
                        TreeBudget(3, 8))
    assert m.tree == TokenTree((a, b, d), (-1, 0, 0))
    assert m.proposers == (("ngram", "suffix"), ("ngram",), ("suffix",))


def test_whole_trees_when_the_budget_allows():
    t1 = TokenTree((1, 2, 3), (-1, 0, 0))        # root → 1 → {2, 3}
    t2 = TokenTree((1, 3, 4, 5), (-1, 0, 1, -1))  # root → 1 → 3 → 4, root → 5
    m = merge_proposals([("x", t1), ("y", t2)], TreeBudget(16, 8))
    assert sorted(paths(m.tree)) == sorted({*paths(t1), *paths(t2)})
    assert len(m.tree) == 5  # 1 and 1 → 3 stored once
    by_path = dict(zip(paths(m.tree), m.proposers))
    assert by_path == {(1,): ("x", "y"), (1, 2): ("x",), (1, 3): ("x", "y"), (1, 3, 4): ("y",), (5,): ("y",)}


def test_agreeing_drafters_cost_nothing_extra():
    chain = TokenTree.chain([1, 2, 3, 4, 5, 6])
    m = merge_proposals([("x", chain), ("y", chain)], TreeBudget(6, 6))
    assert m.tree == chain and all(p == ("x", "y") for p in m.proposers)


def test_round_robin_share_and_leftovers():
    x = TokenTree.chain([1, 2, 3, 4, 5, 6])
    y = TokenTree.chain([7, 8, 9, 10, 11, 12])
    m = merge_proposals([("x", x), ("y", y)], TreeBudget(6, 6))
    assert sorted(paths(m.tree)) == sorted(paths(TokenTree.chain([1, 2, 3])) + paths(TokenTree.chain([7, 8, 9])))
    m = merge_proposals([("x", x), ("y", y)], TreeBudget(5, 6))  # the first named gets the odd node
    assert len(m.tree) == 5 and m.proposers.count(("x",)) == 3
    short = TokenTree.chain([7])
    m = merge_proposals([("x", x), ("y", short)], TreeBudget(6, 6))  # y's unused share goes to x
    assert sorted(paths(m.tree)) == sorted(paths(TokenTree.chain([1, 2, 3, 4, 5])) + [(7,)])
    m = merge_proposals([("x", TokenTree.empty()), ("y", y)], TreeBudget(4, 6))
    assert m.tree == TokenTree.chain([7, 8, 9, 10]) and m.proposers == (("y",),) * 4


def test_each_drafter_gets_the_whole_budget_and_depth_is_respected():
    x = Fixed("x", TokenTree.chain([1, 2, 3, 4]))
    y = Fixed("y", TokenTree((1, 5, 6), (-1, 0, -1)))
    d = MergeDrafter([x, y])
    tree = d.propose(CTX, TreeBudget(8, 2))
    assert x.budgets == y.budgets == [TreeBudget(8, 2)]
    assert max(depths(tree)) <= 2 and sorted(paths(tree)) == [(1,), (1, 2), (1, 5), (6,)]
    # Even a call that may not speculate reaches every drafter (they may keep per-request state).
    assert d.propose(CTX, NO_SPECULATION) == TokenTree.empty() and x.budgets[-1] == y.budgets[-1] == NO_SPECULATION


@pytest.mark.parametrize("seed", range(40))
def test_random_trees(seed):
    rng = np.random.default_rng(seed)
    names = ["a", "b", "c"][: int(rng.integers(1, 4))]
    trees = [random_tree(rng) for _ in names]
    budget = TreeBudget(int(rng.integers(0, 12)), int(rng.integers(0, 5)))
    m = merge_proposals(list(zip(names, trees)), budget)
    got = paths(m.tree)
    assert len(got) == len(set(got)) <= budget.max_nodes  # every path once, within the budget
    assert all(d <= budget.max_depth for d in depths(m.tree))
    cut = [truncate(t, budget.max_nodes, budget.max_depth) for t in trees]  # what drafters may propose
    allowed = {p: [n for n, t in zip(names, cut) if p in paths(t)] for t in cut for p in paths(t)}
    for p, who in zip(got, m.proposers):
        assert list(who) == allowed[p]  # the proposers, in drafter order
    union = set(allowed)
    if len(union) <= budget.max_nodes:
        assert set(got) == union  # nothing dropped that fits
    else:
        assert len(got) == budget.max_nodes  # the budget is used up


def test_draft_probs_travel_with_their_node():
    q1, q2, q3 = (np.full(4, 0.25), np.array([0.1, 0.2, 0.3, 0.4]), np.array([0.7, 0.1, 0.1, 0.1]))
    sampled = TokenTree((1, 2), (-1, 0), (q1, q2))   # a sampled drafter's tree: root → 1 → 2
    one_hot = TokenTree((1, 3), (-1, -1))             # deterministic: root → 1, root → 3
    m = merge_proposals([("model", sampled), ("ngram", one_hot)], TreeBudget(8, 8))
    assert m.tree.tokens == (1, 2, 3)
    assert m.tree.draft_probs[0] is q1 and m.tree.draft_probs[1] is q2 and m.tree.draft_probs[2] is None
    # The first proposer's q wins on a shared node (workers.speculation.tree.merge's rule).
    m = merge_proposals([("ngram", one_hot), ("model", TokenTree((1,), (-1,), (q3,)))], TreeBudget(8, 8))
    assert m.tree.draft_probs is None and m.proposers[0] == ("ngram", "model")
    # Deterministic drafters only: the tree stays plain.
    assert merge_proposals([("x", one_hot), ("y", one_hot)], TreeBudget(8, 8)).tree.draft_probs is None


def test_real_drafters_merge_and_release():
    ngram = NgramDrafter(min_ngram=2)
    suffix = SuffixDrafter()
    d = MergeDrafter([ngram, suffix])
    assert d.name == "merge:ngram+suffix" and isinstance(d, Drafter)
    suffix.propose(DraftContext("old", "A", [9, 8, 1, 2, 7, 7, 7], 2), NO_SPECULATION)
    suffix.release("old")  # the tenant's cache: "1 2" → 7 7 7
    c = DraftContext("r", "A", [1, 2, 3, 4, 1, 2], 6)  # own text: "1 2" → 3 4
    m = d.propose_merged(c, TreeBudget(8, 8))
    by_path = dict(zip(paths(m.tree), m.proposers))
    assert by_path[(3,)] == ("ngram", "suffix") and by_path[(7,)] == ("suffix",)
    assert d.propose(c, NO_SPECULATION) == TokenTree.empty()
    assert d.propose_merged(c, NO_SPECULATION) == MergedTree(TokenTree.empty(), ())
    d.release("r")
    assert "r" not in ngram._indexes and "r" not in suffix._requests
    x, y = Fixed("x", TokenTree.empty()), Fixed("y", TokenTree.empty())
    MergeDrafter([x, y]).release("q")
    assert x.released == y.released == ["q"]


def test_bad_merges():
    with pytest.raises(ValueError, match="at least 2"):
        MergeDrafter([NgramDrafter()])
    with pytest.raises(ValueError, match="distinct"):
        MergeDrafter([NgramDrafter(), NgramDrafter()])
    with pytest.raises(ValueError, match="distinct"):
        merge_proposals([("x", TokenTree.empty()), ("x", TokenTree.empty())], TreeBudget(1, 1))
    with pytest.raises(ValueError, match="proposer entries"):
        MergedTree(TokenTree.chain([1]), ())


# --- registry -----------------------------------------------------------------------------------


def test_merge_syntax_in_the_registry():
    d = create_drafter("merge:ngram+suffix")
    assert isinstance(d, MergeDrafter) and d.name == "merge:ngram+suffix"
    assert [p.name for p in d.drafters] == ["ngram", "suffix"]
    assert d.drafters[0].min_ngram == 1  # the registry's ngram defaults
    d = create_drafter("merge:suffix+ngram", suffix={"min_prob": 0.3}, ngram={"max_ngram": 3})
    assert d.name == "merge:suffix+ngram" and d.drafters[0].min_prob == 0.3 and d.drafters[1].max_ngram == 3
    assert create_drafter("merge:none+ngram+suffix").name == "merge:none+ngram+suffix"
    assert "merge:ngram+suffix" in drafter_names() and "suffix" in drafter_names()
    assert is_drafter_name("merge:suffix+ngram") and is_drafter_name("ngram")
    assert not is_drafter_name("merge:ngram") and not is_drafter_name("merge:ngram+nope") and not is_drafter_name("x")


@pytest.mark.parametrize(
    "name, options, message",
    [
        ("merge:ngram", {}, "2 or more distinct"),
        ("merge:ngram+ngram", {}, "2 or more distinct"),
        ("merge:ngram+nope", {}, "unknown part 'nope'"),
        ("merge:", {}, "2 or more"),
        ("mergengram+suffix", {}, "unknown drafter"),
        ("merge:ngram+suffix", {"model": {}}, "names none of its parts"),
    ],
)
def test_bad_merge_names(name, options, message):
    with pytest.raises(ValueError, match=message):
        create_drafter(name, **options)


def test_a_registry_merges_its_own_drafters():
    reg = Registry({"x": lambda: Fixed("x", TokenTree.chain([1])), "y": lambda: Fixed("y", TokenTree.chain([2]))})
    assert reg.names() == ["x", "y"]  # merge:ngram+suffix is listed only where both are registered
    d = reg.create("merge:x+y")
    assert sorted(paths(d.propose(CTX, TreeBudget(4, 4)))) == [(1,), (2,)]
    assert reg.knows("merge:y+x") and not reg.knows("merge:x+ngram")
    assert Registry().names() == ["grammar", "merge:ngram+suffix", "ngram", "none", "suffix"]
