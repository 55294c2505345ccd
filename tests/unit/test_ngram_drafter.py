"""N-gram (prompt lookup) drafter on hand-written token lists, its incremental index, and the registry."""

import numpy as np
import pytest

import workers.drafters.registry as registry
from workers.drafters.base import Drafter, NoneDrafter
from workers.contract import NO_SPECULATION, DraftContext, TreeBudget
from workers.drafters.ngram import NgramDrafter, _RequestIndex
from workers.drafters.registry import Registry, create_drafter, drafter_names, register_drafter
from workers.speculation.tree import TokenTree, depths


def ctx(tokens, request_id="r1", prompt_len=None):
    return DraftContext(request_id, "tenant-a", list(tokens), len(tokens) if prompt_len is None else prompt_len)


def propose(tokens, max_nodes=16, max_depth=8, **options):
    return NgramDrafter(**options).propose(ctx(tokens), TreeBudget(max_nodes, max_depth))


# --- what gets proposed -------------------------------------------------------------------------


def test_single_match_gives_a_chain():
    #            0  1  2  3  4  5  6 | root = last 2
    assert propose([1, 2, 3, 4, 5, 1, 2], max_depth=3) == TokenTree.chain([3, 4, 5])
    # The continuation stops at the end of the context.
    assert propose([1, 2, 3, 4, 5, 1, 2]) == TokenTree.chain([3, 4, 5, 1, 2])


def test_two_continuations_give_two_branches_most_recent_first():
    tokens = [5, 1, 2, 3, 6, 1, 2, 4, 7, 1, 2]  # "1 2" was followed by 3, later by 4
    assert propose(tokens, max_depth=1) == TokenTree((4, 3), (-1, -1))
    assert propose(tokens, max_depth=2) == TokenTree((4, 7, 3, 6), (-1, 0, -1, 2))


def test_docstring_example():
    a, b, c, d, e = range(5)
    assert propose([a, b, c, d, a, b, e, a, b], max_depth=2) == TokenTree((e, a, c, d), (-1, 0, -1, 2))


def test_longest_ngram_preferred_over_recency():
    # "1 2 3" matched once (→ 10), the shorter "2 3" more recently (→ 11): 10 comes first.
    tokens = [1, 2, 3, 10, 9, 2, 3, 11, 1, 2, 3]
    assert propose(tokens, max_depth=1) == TokenTree((10, 11), (-1, -1))
    assert propose(tokens, max_nodes=1, max_depth=1) == TokenTree((10,), (-1,))
    # With min_ngram=3 the shorter match is not used at all.
    assert propose(tokens, max_depth=1, min_ngram=3) == TokenTree((10,), (-1,))
    # With max_ngram=2 both are "2 3" matches and recency decides.
    assert propose(tokens, max_depth=1, max_ngram=2) == TokenTree((11, 10), (-1, -1))


def test_more_matches_outweigh_recency():
    # "7" was followed by 1 twice, then (most recently) by 2: the branch with more support comes first.
    tokens = [7, 1, 0, 7, 1, 0, 7, 2, 0, 7]
    tree = propose(tokens, max_depth=1, max_ngram=1)
    assert tree.tokens == (1, 2)


def test_shared_prefixes_are_merged_into_a_trie():
    # "0" followed by "1 2" twice and by "1 3" once: root → 1 → {2, 3}.
    tokens = [0, 1, 2, 0, 1, 3, 0, 1, 2, 0]
    tree = propose(tokens, max_depth=2, max_ngram=1)
    assert tree == TokenTree((1, 2, 3), (-1, 0, 0))


def test_nothing_to_match_gives_empty_tree():
    assert propose([1, 2, 3, 4]) == TokenTree.empty()
    assert propose([7]) == TokenTree.empty()
    assert propose([]) == TokenTree.empty()
    assert propose([1, 2, 1, 2], min_ngram=3) == TokenTree.empty()


def test_zero_budget_gives_empty_tree():
    tokens = [1, 2, 3, 1, 2]
    assert propose(tokens, max_nodes=0) == TokenTree.empty()
    assert propose(tokens, max_depth=0) == TokenTree.empty()
    assert NgramDrafter().propose(ctx(tokens), NO_SPECULATION) == TokenTree.empty()


def test_max_matches_bounds_branches():
    tokens = [0, 1, 0, 2, 0, 3, 0, 4, 0]  # "0" followed by 1, 2, 3, 4
    assert len(propose(tokens, max_depth=1, max_ngram=1)) == 4
    assert propose(tokens, max_depth=1, max_ngram=1, max_matches=2).tokens == (4, 3)


def continuations(tokens, min_n, max_n):
    """Brute force: every continuation of an earlier occurrence of a suffix of length in [min_n, max_n]."""
    out = []
    for n in range(min_n, max_n + 1):
        if len(tokens) < n + 1:
            continue
        suffix = tokens[-n:]
        for e in range(n, len(tokens)):
            if tokens[e - n : e] == suffix:
                out.append(tuple(tokens[e:]))
    return out


@pytest.mark.parametrize("seed", range(30))
def test_budget_respected_and_every_path_was_seen(seed):
    rng = np.random.default_rng(seed)
    tokens = [int(t) for t in rng.integers(0, 4, size=int(rng.integers(1, 60)))]
    budget = TreeBudget(int(rng.integers(0, 12)), int(rng.integers(0, 6)))
    tree = NgramDrafter(max_ngram=3, min_ngram=1).propose(ctx(tokens), budget)
    assert len(tree) <= budget.max_nodes
    assert all(d <= budget.max_depth for d in depths(tree))
    conts = continuations(tokens, 1, 3)
    paths: list[tuple[int, ...]] = []
    for tok, par in zip(tree.tokens, tree.parents):
        paths.append((paths[par] if par >= 0 else ()) + (tok,))
        assert any(c[: len(paths[-1])] == paths[-1] for c in conts)
    if budget.speculates and conts:
        assert len(tree) > 0


# --- incremental index --------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(10))
def test_incremental_equals_from_scratch(seed):
    rng = np.random.default_rng(1000 + seed)
    text = [int(t) for t in rng.integers(0, 5, size=300)]
    drafter = NgramDrafter(max_ngram=4, min_ngram=1, max_matches=6)
    length = int(rng.integers(1, 20))
    while length <= len(text):
        budget = TreeBudget(int(rng.integers(0, 10)), int(rng.integers(0, 5)))  # zero budgets skip indexing
        c = ctx(text[:length], prompt_len=3)
        fresh = NgramDrafter(max_ngram=4, min_ngram=1, max_matches=6).propose(c, budget)
        assert drafter.propose(c, budget) == fresh
        length += int(rng.integers(1, 6))


def test_each_step_indexes_only_new_tokens(monkeypatch):
    extended: list[int] = []
    original = _RequestIndex.extend

    def spy(self, new, min_n, max_n):
        extended.append(len(new))
        original(self, new, min_n, max_n)

    monkeypatch.setattr(_RequestIndex, "extend", spy)
    drafter = NgramDrafter()
    text = list(range(50)) * 4
    drafter.propose(ctx(text[:100]), TreeBudget(8, 4))
    for n in range(101, 110):
        drafter.propose(ctx(text[:n]), TreeBudget(8, 4))
    assert extended == [100] + [1] * 9


def test_rebuilds_when_context_shrinks_or_changes():
    drafter = NgramDrafter()
    budget = TreeBudget(8, 4)
    drafter.propose(ctx([1, 2, 3, 4, 1, 2, 5, 1, 2]), budget)
    for tokens in ([1, 2, 3, 1], [9, 8, 7, 6, 9, 8, 7, 6, 9, 5, 9], [1, 2, 3, 4, 1, 2, 6, 1, 2, 3]):
        assert drafter.propose(ctx(tokens), budget) == NgramDrafter().propose(ctx(tokens), budget)


def test_requests_are_independent_and_release_forgets():
    drafter = NgramDrafter()
    budget = TreeBudget(8, 4)
    a = drafter.propose(ctx([1, 2, 3, 1, 2], "a"), budget)
    b = drafter.propose(ctx([4, 5, 6, 4, 5], "b"), budget)
    assert a == TokenTree.chain([3, 1, 2]) and b == TokenTree.chain([6, 4, 5])
    drafter.release("a")
    drafter.release("never-seen")  # no error
    assert "a" not in drafter._indexes and "b" in drafter._indexes
    assert drafter.propose(ctx([7, 8, 7], "a"), budget) == TokenTree.chain([8, 7])


def test_accepts_numpy_context():
    c = DraftContext("r", "t", np.array([1, 2, 3, 1, 2]), 2)
    assert NgramDrafter().propose(c, TreeBudget(4, 4)) == TokenTree.chain([3, 1, 2])


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(min_ngram=0), "min_ngram"),
        (dict(min_ngram=3, max_ngram=2), "min_ngram"),
        (dict(max_matches=0), "max_matches"),
    ],
)
def test_options_validated(options, message):
    with pytest.raises(ValueError, match=message):
        NgramDrafter(**options)


# --- budget, none drafter, registry -------------------------------------------------------------


def test_tree_budget():
    assert TreeBudget(4, 2).speculates and not NO_SPECULATION.speculates and not TreeBudget(4, 0).speculates
    with pytest.raises(ValueError, match="max_nodes"):
        TreeBudget(-1, 2)
    with pytest.raises(ValueError, match="max_depth"):
        TreeBudget(1, -2)


def test_none_drafter():
    d = NoneDrafter()
    assert d.propose(ctx([1, 2, 1, 2]), TreeBudget(8, 8)) == TokenTree.empty()
    d.release("r1")


def test_builtins_are_registered_and_satisfy_the_protocol():
    assert {"ngram", "none"} <= set(drafter_names())
    for name in ("ngram", "none"):
        d = create_drafter(name)
        assert isinstance(d, Drafter) and d.name == name
    assert create_drafter("ngram", max_ngram=2, max_matches=3).max_ngram == 2


def test_unknown_drafter_lists_the_available_ones():
    with pytest.raises(ValueError, match=r"unknown drafter 'x'; available: .*ngram.*none"):
        create_drafter("x")


def test_registry_instances_are_independent():
    reg = Registry()
    reg.register("fixed", lambda token=5: type("Fixed", (NoneDrafter,), {"name": "fixed"})())
    assert "fixed" in reg.names() and "fixed" not in drafter_names()
    assert reg.create("fixed").name == "fixed"
    with pytest.raises(ValueError, match="already registered"):
        reg.register("fixed", NoneDrafter)
    reg.register("fixed", NoneDrafter, replace=True)
    assert reg.create("fixed").name == "none"
    assert Registry({}).names() == []
    with pytest.raises(ValueError, match="non-empty"):
        reg.register("", NoneDrafter)


def test_register_drafter_adds_to_the_default_registry(monkeypatch):
    monkeypatch.setattr(registry, "_DEFAULT", Registry())  # keep the process-wide one clean
    register_drafter("mine", NoneDrafter)
    assert "mine" in drafter_names() and isinstance(create_drafter("mine"), NoneDrafter)
