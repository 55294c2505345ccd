"""Acceptance rules on hand-written trees: greedy and speculative sampling, plus warp and params."""

import doctest

import numpy as np
import pytest

import workers.speculation.acceptance as acceptance
from workers.speculation.acceptance import Acceptance, accept_greedy, accept_sampling, warp
from workers.contract import SamplingParams
from workers.speculation.tree import TokenTree

V = 100


def test_doctests():
    assert doctest.testmod(acceptance).failed == 0


# --- SamplingParams and Acceptance --------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_k=-1), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
    ],
)
def test_sampling_params_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_sampling_params_defaults_are_greedy():
    assert SamplingParams().greedy and not SamplingParams(temperature=0.7).greedy


def test_acceptance_properties():
    a = Acceptance(path=(0, 2), tokens=(5, 6, 7))
    assert (a.accepted, a.bonus, a.tau) == (2, 7, 3)
    with pytest.raises(ValueError):
        Acceptance(path=(0,), tokens=(5,))


# --- warp ---------------------------------------------------------------------------------------


def test_warp_greedy_is_one_hot_at_argmax():
    p = warp(np.array([0.1, 3.0, -2.0, 2.9]), SamplingParams())
    np.testing.assert_array_equal(p, [0, 1, 0, 0])


def test_warp_temperature_is_softmax():
    logits = np.array([1.0, 2.0, 0.5])
    for t in (0.5, 1.0, 2.0):
        e = np.exp(logits / t)
        np.testing.assert_allclose(warp(logits, SamplingParams(temperature=t)), e / e.sum())


def test_warp_worked_example():
    logits = np.array([2.0, 1.0, 0.0, -np.inf])
    np.testing.assert_allclose(warp(logits, SamplingParams(1.0)), [0.665, 0.245, 0.090, 0], atol=1e-3)
    np.testing.assert_allclose(warp(logits, SamplingParams(1.0, top_k=2)), [0.731, 0.269, 0, 0], atol=1e-3)
    np.testing.assert_array_equal(warp(logits, SamplingParams(1.0, top_k=2, top_p=0.7)), [1, 0, 0, 0])


def test_warp_top_k_then_top_p_order():
    # probs ≈ [.64, .24, .09, .03] at T=1. top_p=.9 alone keeps 3 tokens; with top_k=2 first, the
    # renormalised top two are [.73, .27] and top_p=.9 keeps both.
    logits = np.array([3.0, 2.0, 1.0, 0.0])
    assert np.count_nonzero(warp(logits, SamplingParams(1.0, top_p=0.9))) == 3
    assert np.count_nonzero(warp(logits, SamplingParams(1.0, top_k=2, top_p=0.9))) == 2
    assert np.count_nonzero(warp(logits, SamplingParams(1.0, top_k=10))) == 4  # k >= V: off


def test_warp_top_p_keeps_smallest_set_reaching_mass():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    for top_p, kept in [(0.5, 1), (0.51, 2), (0.8, 2), (0.81, 3), (0.96, 4), (1e-9, 1)]:
        p = warp(logits, SamplingParams(1.0, top_p=top_p))
        assert np.count_nonzero(p) == kept, top_p
        assert p.sum() == pytest.approx(1.0)


def reference_top_p(probs, top_p):
    """Brute force: sort every token, keep the shortest prefix whose mass reaches top_p."""
    order = np.argsort(-probs, kind="stable")
    n_keep = 1
    while probs[order[:n_keep]].sum() < top_p - 1e-12:
        n_keep += 1
    out = np.zeros_like(probs)
    out[order[:n_keep]] = probs[order[:n_keep]]
    return out / out.sum()


@pytest.mark.parametrize("vocab", [10, 5000])
@pytest.mark.parametrize("scale", [0.1, 1.0, 5.0])
@pytest.mark.parametrize("top_p", [0.3, 0.9, 0.99])
def test_warp_top_p_matches_a_full_sort(vocab, scale, top_p):
    # Peaked to flat distributions: the kept set fits in the first 64 candidates, in 1024, or needs
    # the whole vocabulary (e.g. 5000 tokens, scale 0.1, top_p 0.99).
    logits = np.random.default_rng(vocab).normal(size=vocab) * scale
    p = warp(logits, SamplingParams(1.0, top_p=top_p))
    np.testing.assert_allclose(p, reference_top_p(warp(logits, SamplingParams(1.0)), top_p), atol=1e-12)


def test_warp_top_k_keeps_ties():
    p = warp(np.array([1.0, 2.0, 2.0, 0.0]), SamplingParams(1.0, top_k=1))
    np.testing.assert_allclose(p, [0, 0.5, 0.5, 0])


def test_warp_is_float64_stable_and_leaves_input_alone():
    logits = np.array([1e4, 1e4 - 1, -1e4, -np.inf], dtype=np.float32)
    before = logits.copy()
    p = warp(logits, SamplingParams(temperature=0.01))
    assert p.dtype == np.float64 and np.all(np.isfinite(p)) and p.sum() == pytest.approx(1.0)
    assert p[0] == pytest.approx(1.0) and p[3] == 0.0
    p = warp(logits, SamplingParams(temperature=1000.0, top_k=3, top_p=0.99))
    assert np.all(np.isfinite(p)) and p.sum() == pytest.approx(1.0)
    np.testing.assert_array_equal(logits, before)


# --- accept_greedy / accept_sampling: one table ------------------------------------------------
#
# root ─┬─ 0:10 ── 1:11 ── 2:12        (a deep branch)
#       └─ 3:13 ── 4:14                (a shallower sibling branch)
#         rows: 0 = root, 1..5 = nodes 0..4
TREE = TokenTree((10, 11, 12, 13, 14), (-1, 0, 1, -1, 3))
# root ─┬─ 0:20                        (shallow leaf first)
#       └─ 1:21 ── 2:22 ── 3:23        (deep branch)
DEEP = TokenTree((20, 21, 22, 23), (-1, -1, 1, 2))

CASES = [
    # name, tree, target argmax per row (row 0 = root), expected path, expected tokens
    ("perfect match, bonus from deepest row", TREE, [10, 11, 12, 99, 0, 0], (0, 1, 2), (10, 11, 12, 99)),
    ("mismatch at the root", TREE, [50, 11, 12, 99, 14, 0], (), (50,)),
    ("mismatch mid-branch", TREE, [10, 77, 12, 99, 0, 0], (0,), (10, 77)),
    ("sibling wins", TREE, [13, 11, 12, 99, 14, 42], (3, 4), (13, 14, 42)),
    ("sibling, early stop", TREE, [13, 0, 0, 0, 5, 0], (3,), (13, 5)),
    ("empty tree: just a bonus", TokenTree.empty(), [7], (), (7,)),
    ("deep branch beats shallow sibling", DEEP, [21, 0, 22, 23, 30], (1, 2, 3), (21, 22, 23, 30)),
    ("shallow branch: bonus at its leaf", DEEP, [20, 31, 22, 23, 30], (0,), (20, 31)),
    ("chain", TokenTree.chain([1, 2, 3]), [1, 2, 9, 9], (0, 1), (1, 2, 9)),
]


@pytest.mark.parametrize("name, tree, argmax, path, tokens", CASES, ids=[c[0] for c in CASES])
def test_accept_greedy_table(name, tree, argmax, path, tokens):
    assert len(argmax) == len(tree) + 1
    a = accept_greedy(tree, np.array(argmax))
    assert (a.path, a.tokens) == (path, tokens)
    assert a.accepted == len(path) and a.bonus == tokens[-1]


def one_hot(token: int) -> np.ndarray:
    p = np.zeros(V)
    p[token] = 1.0
    return p


@pytest.mark.parametrize("name, tree, argmax, path, tokens", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("seed", range(3))
def test_accept_sampling_table_with_one_hot_target(name, tree, argmax, path, tokens, seed):
    # A one-hot target (greedy warp) makes sampling deterministic: it must agree with greedy.
    calls = []

    def target(row):
        calls.append(row)
        return one_hot(argmax[row])

    a = accept_sampling(tree, target, np.random.default_rng(seed))
    assert (a.path, a.tokens) == (path, tokens)
    # Lazy: the walk asks for exactly the rows it stands on, root first, each once.
    assert calls == [0] + [i + 1 for i in path]


def test_accept_sampling_one_hot_draft_probs_equal_deterministic():
    # Explicit one-hot q is the same as draft_probs=None.
    probs = tuple(one_hot(t) for t in TREE.tokens)
    with_q = TokenTree(TREE.tokens, TREE.parents, probs)
    rng_target = np.random.default_rng(0)
    ps = [rng_target.dirichlet(np.ones(V) * 0.05) for _ in range(len(TREE) + 1)]
    for seed in range(20):
        a = accept_sampling(TREE, lambda r: ps[r], np.random.default_rng(seed))
        b = accept_sampling(with_q, lambda r: ps[r], np.random.default_rng(seed))
        assert a == b


def test_accept_sampling_visits_siblings_in_random_order():
    # p is uniform over the two siblings, so whichever is tried first is accepted (p/q = 0.5 then
    # the residual puts all mass on the other): over seeds both must come first.
    tree = TokenTree((1, 2), (-1, -1))
    p = np.zeros(V)
    p[[1, 2]] = 0.5
    firsts = {accept_sampling(tree, lambda r: p, np.random.default_rng(s)).tokens[0] for s in range(40)}
    assert firsts == {1, 2}


def test_accept_sampling_never_commits_zero_probability_tokens():
    p = np.zeros(V)
    p[[3, 4]] = [0.25, 0.75]
    before = p.copy()
    tree = TokenTree((5, 3), (-1, -1))  # 5 has p = 0: always rejected
    for s in range(200):
        a = accept_sampling(tree, lambda r: p, np.random.default_rng(s))
        assert a.tokens[0] in (3, 4) and all(t in (3, 4) for t in a.tokens)
    np.testing.assert_array_equal(p, before)  # residuals are new arrays: the caller's p is untouched


def test_accept_sampling_stochastic_q_accepts_with_ratio():
    # q puts .8 on token 1, p only .4: accepted with probability .5; else the residual
    # max(0, p - q) = {2: .6 - .2 = .4} → the bonus is token 2 for sure.
    p = np.zeros(V)
    p[[1, 2]] = [0.4, 0.6]
    q = np.zeros(V)
    q[[1, 2]] = [0.8, 0.2]
    tree = TokenTree.chain([1], [q])
    outs = [accept_sampling(tree, lambda r: p, np.random.default_rng(s)).tokens for s in range(2000)]
    rejected = [t for t in outs if len(t) == 1]
    assert all(t == (2,) for t in rejected)
    assert 0.45 < 1 - len(rejected) / len(outs) < 0.55


def test_accept_sampling_rejects_inconsistent_q():
    q = np.zeros(V)
    q[2] = 1.0
    tree = TokenTree.chain([1], [q])  # node 1 claims to have been drawn from q with q[1] = 0
    with pytest.raises(ValueError, match="probability 0"):
        accept_sampling(tree, lambda r: np.full(V, 1.0 / V), np.random.default_rng(0))


def test_residual_and_sample_helpers():
    p = np.array([0.5, 0.5, 0.0])
    np.testing.assert_allclose(acceptance._residual(p, None, 0), [0, 1, 0])
    np.testing.assert_allclose(acceptance._residual(p, np.array([0.25, 0.75, 0]), 0), [1, 0, 0])
    # p == q: the residual has no mass (only reachable through rounding): p is kept.
    np.testing.assert_allclose(acceptance._residual(p, p, 0), p)
    rng = np.random.default_rng(0)
    draws = [acceptance._sample(np.array([0.0, 2.0, 0.0, 1.0, 0.0]), rng) for _ in range(3000)]
    assert set(draws) == {1, 3}
    assert 0.63 < draws.count(1) / len(draws) < 0.70
