"""Multi-step speculative sampling must commit tokens distributed exactly as the target's own sampling.

Toy target: a random first-order Markov model over V = 6 tokens (the next token depends on the
previous one through a fixed random logit matrix), warped with temperature and top-k so some tokens
are impossible. Toy drafter: a different Markov model Q, so drafts are often but not always right.
Each trial drafts a tree under a fixed root, runs ``accept_sampling`` and takes the first two
committed tokens (a step that commits only one token is followed by a second step from the new
root). Their empirical frequencies are compared with the exact target distribution by a G-test.

Two kinds of drafts:
  (a) deterministic trees with sibling branches (q one-hot): sibling residuals, deep/shallow paths.
  (b) stochastic trees: every node carries a non-degenerate q and was drawn from it; the root's two
      siblings are drawn independently from q restricted to even / odd tokens (disjoint supports,
      which keeps sibling draws independent, see ``accept_sampling``'s NOTE), deeper nodes from the
      full q. Exercises p/q acceptance ratios and max(0, p − q) residuals.
The last tests break the residual update on purpose and check that this test notices.
"""

import functools

import numpy as np
import pytest
from scipy.stats import power_divergence

import workers.speculation.acceptance as acceptance
from workers.speculation.acceptance import accept_sampling, warp
from workers.contract import SamplingParams
from workers.speculation.tree import TokenTree

V = 6
ROOT = 2
TRIALS = 6_000
PARAMS = SamplingParams(temperature=0.9, top_k=4)

_model_rng = np.random.default_rng(1234)
_target_logits = 1.5 * _model_rng.normal(size=(V, V))
P = np.stack([warp(row, PARAMS) for row in _target_logits])  # [V, V]: P[prev] = next-token dist
_draft_logits = 0.7 * _target_logits + _model_rng.normal(size=(V, V))
Q = np.exp(_draft_logits) / np.exp(_draft_logits).sum(axis=1, keepdims=True)  # [V, V], full support
assert np.all(Q > 0) and np.all((P == 0).sum(axis=1) == 2)  # top-k=4 removes 2 tokens per row


@functools.lru_cache(maxsize=None)  # a pure function of the root: build each tree once
def _deterministic_tree(root: int) -> TokenTree:
    """root ─┬─ a ─┬─ c ── e      a, b = Q's top two after the root; c, d = top two after a; ...
             │     └─ d
             └─ b ── f"""
    a, b = np.argsort(-Q[root])[:2]
    c, d = np.argsort(-Q[a])[:2]
    e = np.argmax(Q[c])
    f = np.argmax(Q[b])
    return TokenTree((a, b, c, d, e, f), (-1, -1, 0, 0, 2, 1))


def deterministic_tree(root: int, rng: np.random.Generator) -> TokenTree:
    return _deterministic_tree(root)


EVEN = np.arange(V) % 2 == 0
# Per root, the two sibling distributions: Q[root] restricted to even / to odd tokens.
Q_HALVES = [tuple(np.where(half, Q[r], 0.0) / np.where(half, Q[r], 0.0).sum() for half in (EVEN, ~EVEN)) for r in range(V)]
Q_CDF = np.cumsum(Q, axis=1)
Q_HALVES_CDF = [tuple(np.cumsum(q) for q in halves) for halves in Q_HALVES]


def _draw(cdf: np.ndarray, rng: np.random.Generator) -> int:
    return min(int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right")), V - 1)


def stochastic_tree(root: int, rng: np.random.Generator) -> TokenTree:
    """root ─┬─ x0 ── y0 ── z0      x0 ~ Q[root] on even tokens, x1 ~ Q[root] on odd tokens,
             └─ x1 ── y1            y ~ Q[x], z ~ Q[y] (full support)."""
    tokens, parents, probs = [], [], []
    for half, depth in ((0, 3), (1, 2)):
        tokens.append(_draw(Q_HALVES_CDF[root][half], rng))
        parents.append(-1)
        probs.append(Q_HALVES[root][half])
        for _ in range(depth - 1):
            prev = tokens[-1]
            tokens.append(_draw(Q_CDF[prev], rng))
            parents.append(len(tokens) - 2)
            probs.append(Q[prev])
    return TokenTree(tuple(tokens), tuple(parents), tuple(probs))


def step(draft, root: int, rng: np.random.Generator) -> tuple[int, ...]:
    tree = draft(root, rng)
    # Row 0 is the root, row r > 0 is node r - 1; the toy target only looks at the previous token.
    return accept_sampling(tree, lambda row: P[root if row == 0 else tree.tokens[row - 1]], rng).tokens


def first_two_tokens(draft, seed: int, trials: int = TRIALS) -> np.ndarray:
    """Counts ``[V, V]`` of (first, second) committed token over independent trials."""
    rng = np.random.default_rng(seed)
    counts = np.zeros((V, V), dtype=np.int64)
    for _ in range(trials):
        tokens = step(draft, ROOT, rng)
        if len(tokens) == 1:
            tokens += step(draft, tokens[0], rng)
        counts[tokens[0], tokens[1]] += 1
    return counts


def g_test_pvalue(observed: np.ndarray, probs: np.ndarray) -> float:
    """G-test of counts against exact probabilities; cells expecting < 5 are pooled. A count in a
    cell of probability 0 is an outright failure (p-value 0)."""
    obs = observed.ravel().astype(float)
    exp = probs.ravel() * obs.sum()
    if obs[exp == 0].sum() > 0:
        return 0.0
    big = exp >= 5
    small = ~big & (exp > 0)
    o = np.append(obs[big], obs[small].sum())
    e = np.append(exp[big], exp[small].sum())
    if e[-1] == 0:
        o, e = o[:-1], e[:-1]
    return float(power_divergence(o, e, lambda_="log-likelihood").pvalue)


EXACT_FIRST = P[ROOT]  # [V]
EXACT_PAIR = P[ROOT][:, None] * P  # [V, V]: P(x1) P(x2 | x1)


def check(counts: np.ndarray) -> tuple[float, float]:
    return g_test_pvalue(counts.sum(axis=1), EXACT_FIRST), g_test_pvalue(counts, EXACT_PAIR)


@pytest.mark.parametrize("draft, seed", [(deterministic_tree, 7), (stochastic_tree, 8)], ids=["one-hot", "stochastic"])
def test_committed_tokens_follow_the_target(draft, seed):
    counts = first_two_tokens(draft, seed)
    p_first, p_pair = check(counts)
    assert p_first > 1e-3, (p_first, counts.sum(axis=1) / TRIALS, EXACT_FIRST)
    assert p_pair > 1e-3, p_pair


def test_trials_exercise_siblings_residuals_and_bonus():
    """The test above only means something if the interesting branches happen often."""
    rng = np.random.default_rng(0)
    seen = {"second sibling accepted": 0, "bonus after rejection at root": 0, "reached a leaf": 0}
    for draft in (deterministic_tree, stochastic_tree):
        for _ in range(500):
            tree = draft(ROOT, rng)
            a = accept_sampling(tree, lambda row: P[ROOT if row == 0 else tree.tokens[row - 1]], rng)
            seen["second sibling accepted"] += a.path[:1] == (1,) or (draft is stochastic_tree and a.path[:1] == (3,))
            seen["bonus after rejection at root"] += a.accepted == 0
            seen["reached a leaf"] += bool(a.path) and a.path[-1] not in tree.parents
    assert all(n >= 50 for n in seen.values()), seen


# --- the test can fail: break the residual update and it must notice ----------------------------


def _no_residual(p, q, x):
    return p  # forgets the rejected draft: the rejected token is over-produced


def _one_hot_residual(p, q, x):
    r = p.copy()
    r[x] = 0.0  # treats every q as one-hot: wrong for stochastic drafts
    return r / r.sum()


def _unnormalised_residual(p, q, x):
    r = p.copy()
    r[x] = 0.0
    return r if q is None else np.maximum(p - q, 0.0)  # the next ratio p[x] / q[x] comes out too small


@pytest.mark.parametrize(
    "broken, draft",
    [
        (_no_residual, deterministic_tree),
        (_one_hot_residual, stochastic_tree),
        (_unnormalised_residual, stochastic_tree),
    ],
    ids=["no-residual/one-hot", "one-hot-residual/stochastic", "unnormalised/stochastic"],
)
def test_detects_a_broken_residual(monkeypatch, broken, draft):
    monkeypatch.setattr(acceptance, "_residual", broken)
    p_first, p_pair = check(first_two_tokens(draft, seed=11, trials=TRIALS // 2))
    assert min(p_first, p_pair) < 1e-3


# --- the coupled rule (seeded requests): exact, and the same text whatever was drafted -----------


def coupled_step(draft, root: int, rng: np.random.Generator) -> tuple[int, ...]:
    tree = draft(root, rng)
    return acceptance.accept_coupled(tree, lambda row: P[root if row == 0 else tree.tokens[row - 1]],
                                     lambda depth: rng.random()).tokens


@pytest.mark.parametrize("draft, seed", [(deterministic_tree, 17), (stochastic_tree, 18)],
                         ids=["one-hot", "stochastic"])
def test_the_coupled_rule_commits_tokens_that_follow_the_target(draft, seed):
    rng = np.random.default_rng(seed)
    counts = np.zeros((V, V), dtype=np.int64)
    for _ in range(TRIALS):
        tokens = coupled_step(draft, ROOT, rng)
        if len(tokens) == 1:
            tokens += coupled_step(draft, tokens[0], rng)
        counts[tokens[0], tokens[1]] += 1
    p_first, p_pair = check(counts)
    assert p_first > 1e-3 and p_pair > 1e-3, (p_first, p_pair)


def junk_tree(root: int, rng: np.random.Generator) -> TokenTree:
    """Drafts that ignore the model: a random chain."""
    tokens = tuple(int(t) for t in rng.permutation(V)[:3])
    return TokenTree(tokens, (-1, 0, 1))


def no_tree(root: int, rng: np.random.Generator) -> TokenTree:
    return TokenTree.empty()


def seeded_text(draft, seed: int, n: int = 60, draft_seed: int = 0) -> list[int]:
    """A seeded request's first n tokens, decoded step by step with `draft`'s trees, one uniform
    per (seed, absolute position) as the verifier draws them."""
    drafts = np.random.default_rng(draft_seed)
    out = [ROOT]
    while len(out) <= n:
        pos = len(out)
        tree = draft(out[-1], drafts)
        acc = acceptance.accept_coupled(
            tree, lambda row: P[out[-1] if row == 0 else tree.tokens[row - 1]],
            lambda depth: np.random.default_rng([seed, pos + depth]).random())
        out += acc.tokens
    return out[1:n + 1]


def test_a_seeded_text_is_the_same_whatever_was_drafted():
    for seed in (1, 2, 3):
        plain = seeded_text(no_tree, seed)
        for draft in (deterministic_tree, stochastic_tree, junk_tree):
            for draft_seed in (0, 1):
                assert seeded_text(draft, seed, draft_seed=draft_seed) == plain, (seed, draft.__name__)
    assert seeded_text(no_tree, 1) != seeded_text(no_tree, 2)          # the seed does matter
