"""Token tree data and tree math: hand-written cases plus randomized checks against brute force."""

import doctest

import numpy as np
import pytest

import workers.speculation.tree
from workers.speculation.tree import TokenTree, ancestor_mask, children, depths, leaf_paths, merge, truncate

# root ─┬─ 0:10 ─┬─ 1:11 ── 3:13
#       │        └─ 2:12
#       └─ 4:14
T = TokenTree(tokens=(10, 11, 12, 13, 14), parents=(-1, 0, 0, 1, -1))


def random_tree(rng: np.random.Generator, n: int, vocab: int = 4) -> TokenTree:
    """A random valid tree (siblings distinct), built node by node."""
    tokens: list[int] = []
    parents: list[int] = []
    used: set[tuple[int, int]] = set()
    while len(tokens) < n:
        p = int(rng.integers(-1, len(tokens)))
        t = int(rng.integers(vocab))
        if (p, t) not in used:
            used.add((p, t))
            tokens.append(t)
            parents.append(p)
    return TokenTree(tuple(tokens), tuple(parents))


def token_paths(tree: TokenTree) -> set[tuple[int, ...]]:
    """Every node as its root-to-node token path (what a tree *means*, independent of indexing)."""
    paths: list[tuple[int, ...]] = []
    for tok, par in zip(tree.tokens, tree.parents):
        paths.append((paths[par] if par >= 0 else ()) + (tok,))
    return set(paths)


def test_doctests():
    assert doctest.testmod(workers.speculation.tree).failed == 0


# --- construction -------------------------------------------------------------------------------


def test_empty_and_chain():
    assert len(TokenTree.empty()) == 0
    c = TokenTree.chain([4, 5, 6])
    assert c.tokens == (4, 5, 6) and c.parents == (-1, 0, 1)
    assert TokenTree.chain([]) == TokenTree.empty()


def test_coerces_lists_and_numpy_ints():
    t = TokenTree([np.int64(3), 4], np.array([-1, 0]))
    assert t.tokens == (3, 4) and t.parents == (-1, 0)
    assert all(type(x) is int for x in t.tokens + t.parents)


@pytest.mark.parametrize(
    "tokens, parents, probs, message",
    [
        ((1, 2), (-1,), None, "2 tokens but 1 parents"),
        ((1, 2), (-1, 1), None, r"parents\[1\] = 1"),
        ((1, 2), (-1, 5), None, r"parents\[1\] = 5"),
        ((1,), (-2,), None, r"parents\[0\] = -2"),
        ((1, 1), (-1, -1), None, "repeats token 1 under parent -1"),
        ((1, 2, 2), (-1, 0, 0), None, "repeats token 2 under parent 0"),
        ((1, 2), (-1, 0), (None,), "2 tokens but 1 draft_probs"),
        ((1,), (-1,), (np.ones((2, 2)),), r"draft_probs\[0\]"),
        ((1,), (-1,), ([0.5, 0.5],), r"draft_probs\[0\]"),
    ],
)
def test_validation(tokens, parents, probs, message):
    with pytest.raises(ValueError, match=message):
        TokenTree(tokens, parents, probs)


def test_same_token_under_different_parents_is_fine():
    TokenTree((1, 1, 1), (-1, 0, 1))


def test_equality_hash_and_draft_probs():
    q = np.array([0.25, 0.75])
    a = TokenTree((1, 0), (-1, 0), (q, None))
    assert a == TokenTree((1, 0), (-1, 0), (q.copy(), None))
    assert a != TokenTree((1, 0), (-1, 0), (np.array([0.5, 0.5]), None))
    assert a != TokenTree((1, 0), (-1, 0))
    assert hash(a) == hash(TokenTree((1, 0), (-1, 0)))
    # All-None probabilities mean "deterministic", the same as no field at all.
    b = TokenTree((1, 0), (-1, 0), (None, None))
    assert b.draft_probs is None and b == TokenTree((1, 0), (-1, 0))
    assert "draft_probs=<2 entries>" in repr(a)


# --- depths, mask, children, paths --------------------------------------------------------------


def test_depths():
    assert depths(T) == [1, 2, 2, 3, 1]
    assert depths(TokenTree.empty()) == []


def test_ancestor_mask_hand_written():
    expected = np.array(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [1, 0, 1, 0, 0],
            [1, 1, 0, 1, 0],
            [0, 0, 0, 0, 1],
        ],
        dtype=bool,
    )
    m = ancestor_mask(T)
    assert m.dtype == bool and m.shape == (5, 5)
    np.testing.assert_array_equal(m, expected)
    assert ancestor_mask(TokenTree.empty()).shape == (0, 0)


def test_children_rows():
    # Row 0 = root, row i + 1 = node i.
    assert children(T) == [[0, 4], [1, 2], [3], [], [], []]
    assert children(TokenTree.empty()) == [[]]


def test_leaf_paths():
    assert leaf_paths(T) == [[0, 2], [0, 1, 3], [4]]
    assert leaf_paths(TokenTree.empty()) == []
    assert leaf_paths(TokenTree.chain([5, 6])) == [[0, 1]]


@pytest.mark.parametrize("seed", range(20))
def test_mask_depths_paths_agree_with_brute_force(seed):
    rng = np.random.default_rng(seed)
    tree = random_tree(rng, int(rng.integers(1, 25)))
    n = len(tree)

    def ancestors(i):
        out = []
        while i >= 0:
            out.append(i)
            i = tree.parents[i]
        return out

    m = ancestor_mask(tree)
    d = depths(tree)
    for i in range(n):
        assert set(np.flatnonzero(m[i])) == set(ancestors(i))
        assert d[i] == len(ancestors(i))
    leaves = {p[-1] for p in leaf_paths(tree)}
    assert leaves == {i for i in range(n) if i not in tree.parents}
    for path in leaf_paths(tree):
        assert path == ancestors(path[-1])[::-1]
    rows = children(tree)
    assert sorted(c for row in rows for c in row) == list(range(n))


# --- merge --------------------------------------------------------------------------------------


def test_merge_shares_prefixes_and_keeps_first_order():
    a = TokenTree.chain([1, 2, 3])
    b = TokenTree((1, 2, 4, 5), (-1, 0, 1, -1))  # root → 1 → 2 → 4, root → 5
    m = merge([a, b])
    assert m.tokens == (1, 2, 3, 4, 5)
    assert m.parents == (-1, 0, 1, 1, -1)


def test_merge_edge_cases():
    assert merge([]) == TokenTree.empty()
    assert merge([TokenTree.empty(), T]) == T
    assert merge([T, T]) == T
    # The same token under different parents stays two nodes.
    assert len(merge([TokenTree.chain([1, 2]), TokenTree.chain([2])])) == 3


def test_merge_keeps_first_trees_draft_probs():
    q1, q2, q3 = np.array([1.0, 0.0]), np.array([0.0, 1.0]), np.array([0.5, 0.5])
    a = TokenTree.chain([0], [q1])
    b = TokenTree((0, 1), (-1, -1), (q3, q2))
    m = merge([a, TokenTree.chain([7]), b])
    assert m.tokens == (0, 7, 1)
    assert m.draft_probs[0] is q1 and m.draft_probs[1] is None and m.draft_probs[2] is q2
    assert merge([TokenTree.chain([1]), TokenTree.chain([2])]).draft_probs is None


@pytest.mark.parametrize("seed", range(20))
def test_merge_is_the_union_of_paths(seed):
    rng = np.random.default_rng(100 + seed)
    trees = [random_tree(rng, int(rng.integers(0, 10)), vocab=3) for _ in range(3)]
    m = merge(trees)
    assert token_paths(m) == set().union(*(token_paths(t) for t in trees))
    assert len(m) == len(token_paths(m))  # every shared prefix stored once


# --- truncate -----------------------------------------------------------------------------------


def test_truncate_by_nodes_and_depth():
    assert truncate(T, 5, 5) is T
    assert truncate(T, 3, 9) == TokenTree((10, 11, 12), (-1, 0, 0))
    assert truncate(T, 9, 1) == TokenTree((10, 14), (-1, -1))
    # Node 3 (depth 3) is dropped for depth; node 4 still fits.
    assert truncate(T, 4, 2) == TokenTree((10, 11, 12, 14), (-1, 0, 0, -1))
    assert truncate(T, 0, 9) == TokenTree.empty()
    assert truncate(T, 9, 0) == TokenTree.empty()


def test_truncate_skips_children_of_dropped_nodes_and_keeps_probs():
    q = [np.full(3, i / 3.0) for i in range(4)]
    t = TokenTree((1, 2, 3, 4), (-1, 0, 1, -1), q)  # root → 1 → 2 → 3, root → 4
    out = truncate(t, 3, 1)
    assert out.tokens == (1, 4) and out.parents == (-1, -1)
    assert out.draft_probs[0] is q[0] and out.draft_probs[1] is q[3]


@pytest.mark.parametrize("seed", range(20))
def test_truncate_is_a_valid_prefix_subtree(seed):
    rng = np.random.default_rng(200 + seed)
    tree = random_tree(rng, int(rng.integers(1, 30)))
    max_nodes, max_depth = int(rng.integers(0, 12)), int(rng.integers(0, 5))
    out = truncate(tree, max_nodes, max_depth)
    assert len(out) <= max_nodes
    assert all(d <= max_depth for d in depths(out))
    assert token_paths(out) <= token_paths(tree)
    # A node within max_depth has all its ancestors within it too, so "prefer index order" means:
    # exactly the first max_nodes such nodes are kept.
    eligible = [i for i, d in enumerate(depths(tree)) if d <= max_depth][:max_nodes]
    assert out.tokens == tuple(tree.tokens[i] for i in eligible)
