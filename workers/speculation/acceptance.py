"""Acceptance rules: which drafted tokens a step commits. Pure; randomness comes in as an RNG.

Words (docs/design.md): the target verifies every node of the token tree in one pass and gives one
output per **row** (row 0 = the root, row i + 1 = node i; see ``workers.speculation.tree``). Walking down from
the root, a node whose token the rule agrees with is **accepted**; the walk stops at a row where no
child is accepted, and the target adds one **bonus** token there. A step therefore commits
τ = accepted + 1 ≥ 1 tokens, and the committed text is distributed exactly as if the target had
decoded alone (greedy: identical; sampling: the same distribution).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np

from workers.contract import SamplingParams
from workers.speculation.tree import TokenTree, children

__all__ = ["Acceptance", "warp", "accept_greedy", "accept_sampling", "accept_coupled"]


@dataclass(frozen=True)
class Acceptance:
    """Outcome of one step for one request.

    ``path``: accepted node indices, root to deepest. ``tokens``: what to commit, the accepted
    tokens then the bonus token, so ``len(tokens) == len(path) + 1 == tau``.
    """

    path: tuple[int, ...]
    tokens: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.path) + 1:
            raise ValueError(f"Acceptance: {len(self.path)} accepted nodes need {len(self.path) + 1} tokens")

    @property
    def accepted(self) -> int:
        return len(self.path)

    @property
    def bonus(self) -> int:
        return self.tokens[-1]

    @property
    def tau(self) -> int:
        return len(self.tokens)


def warp(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """``[V]`` logits → ``[V]`` float64 probabilities: temperature, then top-k, then top-p.

    Greedy (temperature 0) gives the one-hot distribution at the argmax, so the sampling rule run on
    it reproduces greedy decoding. Top-k keeps ties with the k-th largest logit (as transformers
    does). Top-p keeps the smallest set of most likely tokens whose mass reaches ``top_p``, at least
    one token. Computed in float64 with the max subtracted, so huge logits cannot overflow.

    Worked example: logits ``[2, 1, 0, -inf]`` at temperature 1 give ``[.665, .245, .090, 0]``;
    ``top_k=2`` keeps the first two, ``[.731, .269, 0, 0]``; ``top_p=0.7`` on top of that keeps only
    token 0 (its mass .731 already reaches 0.7), ``[1, 0, 0, 0]``.
    """
    if params.greedy:
        out = np.zeros(np.shape(logits), dtype=np.float64)
        out[int(np.argmax(logits))] = 1.0
        return out
    x = np.array(logits, dtype=np.float64)  # [V], a copy: the caller's logits stay untouched
    x /= params.temperature
    if 0 < params.top_k < x.size:
        kth = np.partition(x, x.size - params.top_k)[x.size - params.top_k]
        x[x < kth] = -np.inf
    x -= np.max(x)
    probs = np.exp(x, out=x)
    probs /= probs.sum()
    return _top_p(probs, params.top_p) if params.top_p < 1.0 else probs


def _top_p(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Keep the smallest set of most likely tokens whose mass reaches ``top_p`` (at least one).

    The kept set is a prefix of the tokens sorted by probability, so it lies within the top m tokens
    as soon as their mass reaches ``top_p``: sort only those (m = 64, then 1024, then all V). A full
    sort of a 49k vocabulary costs many times the softmax, an ``argpartition`` a small multiple
    of it (README.md, "Serving path and start-up times"), and LLM distributions are usually
    peaked enough for the first try. Ties are broken by token id within the candidates.
    """
    # The 1e-12 absorbs rounding in sums (.5 + .3 must reach .8).
    target = top_p - 1e-12
    v = probs.size
    for m in (64, 1024, v):
        if m >= v:
            top = np.arange(v)
            break
        top = np.sort(np.argpartition(-probs, m - 1)[:m])
        if probs[top].sum() >= target:
            break
    order = top[np.argsort(-probs[top], kind="stable")]
    mass_before = np.cumsum(probs[order]) - probs[order]  # non-decreasing
    keep = order[: max(1, int(np.searchsorted(mass_before, target, side="left")))]
    out = np.zeros_like(probs)
    out[keep] = probs[keep]
    return out / out.sum()


def accept_greedy(tree: TokenTree, argmax: Sequence[int]) -> Acceptance:
    """Greedy acceptance: follow the children whose token is the target's argmax.

    ``argmax[r]`` is the target's argmax at row r (row 0 = root, row i + 1 = node i). From the root,
    while a child of the current row carries that row's argmax, accept it and move there; the bonus
    is the argmax at the last accepted row. Siblings are distinct, so at most one child matches.

    Worked example: root → 0:"the" → {1:"cat", 2:"dog"}; the target's argmax at rows
    (root, the, cat, dog) is ("the", "dog", x, "barks"): accept "the" (row 0), then "dog" (row 1);
    row 3 (node 2) has no children, so the bonus is "barks": path (0, 2), tokens (the, dog, barks).
    """
    kids = children(tree)
    path: list[int] = []
    row = 0
    while True:
        want = int(argmax[row])
        nxt = next((c for c in kids[row] if tree.tokens[c] == want), None)
        if nxt is None:
            return Acceptance(tuple(path), tuple(tree.tokens[i] for i in path) + (want,))
        path.append(nxt)
        row = nxt + 1


def accept_sampling(
    tree: TokenTree,
    target_probs: Callable[[int], np.ndarray],
    rng: np.random.Generator,
) -> Acceptance:
    """Multi-step speculative sampling (SpecInfer, Algorithm 2): the committed tokens follow p exactly.

    ``target_probs(row)`` returns the warped target distribution p at that row; it is called only for
    rows the walk reaches (root first), so the caller may compute them on demand. At the current row,
    the children are tried in random order. Child c with token x, drawn from q (``draft_probs[c]``,
    one-hot at x when ``None``), is accepted with probability min(1, p[x] / q[x]). On rejection, p
    becomes the residual normalise(max(0, p − q)) and the next child is tried. An accepted child
    becomes the current row (with its own fresh p); when no child is accepted (or the row is a leaf)
    the bonus is sampled from the current, possibly residual, p.

    Worked example (deterministic drafts, so q is one-hot): the root's children are "a" and "b";
    p at the root is {a: .2, b: .5, c: .3}. Say "a" is tried first: accepted with probability .2; if
    rejected, p becomes {b: .625, c: .375}; "b" is accepted with probability .625, else the bonus is
    "c". Overall P(a) = .2, P(b) = .8 × .625 = .5, P(c) = .8 × .375 = .3, which is p itself.

    NOTE: exactness needs each child's token to be drawn from its own q independently of its
    siblings (deterministic drafts; or independent drafters with disjoint supports). Siblings drawn
    i.i.d. from one q and then de-duplicated are *not* exact (a repeated draw would need its own try),
    and neither are a stochastic and another draft merged into one tree.
    """
    kids = children(tree)
    probs = tree.draft_probs
    path: list[int] = []
    row = 0
    while True:
        p = np.asarray(target_probs(row), dtype=np.float64)  # [V]
        cand = kids[row]
        order = rng.permutation(len(cand)) if len(cand) > 1 else range(len(cand))
        nxt = None
        for k in order:
            c = cand[int(k)]
            q = None if probs is None else probs[c]
            x = tree.tokens[c]
            qx = 1.0 if q is None else float(q[x])
            if qx <= 0.0:
                raise ValueError(f"draft_probs[{c}] gives node {c}'s own token {x} probability {qx}")
            if rng.random() < p[x] / qx:
                nxt = c
                break
            p = _residual(p, q, x)
        if nxt is None:
            bonus = _sample(p, rng)
            return Acceptance(tuple(path), tuple(tree.tokens[i] for i in path) + (bonus,))
        path.append(nxt)
        row = nxt + 1


def accept_coupled(
    tree: TokenTree,
    target_probs: Callable[[int], np.ndarray],
    uniform: Callable[[int], float],
) -> Acceptance:
    """Coupled speculative sampling: the target's token at each position is drawn first, by the
    inverse CDF of p at a uniform that belongs to the position (``uniform(depth)``, depth 0 = the
    root's row), and a child is accepted when it carries exactly that token. The committed tokens
    follow p exactly (each is an inverse-CDF draw from p with a fresh uniform), and they are the
    same whatever was drafted: the drafts only decide how many of them one step commits.

    That is what a seeded request needs: with uniforms from (seed, absolute position), its text is
    the same with speculation on or off, whichever drafter, tree size or batch, after an eviction
    or a restart (a resumed stream continues the text it would have had). For deterministic drafts
    the chance of accepting a child is p[x], as under ``accept_sampling`` (one child, or siblings:
    p[x1] + p[x2] either way); for drafts sampled from q it is Σ q·p instead of Σ min(p, q).

    Worked example: p at the root is {a: .2, b: .5, c: .3} (CDF .2, .7, 1); the uniform at depth 0
    is .45, so the target's token there is "b". Children "a" and "b": "b" is accepted and the walk
    goes on from its row; children "a" and "c" only: nothing is accepted and "b" is the bonus.
    """
    kids = children(tree)
    path: list[int] = []
    row = 0
    while True:
        p = np.asarray(target_probs(row), dtype=np.float64)  # [V]
        want = _inverse_cdf(p, uniform(len(path)))
        nxt = next((c for c in kids[row] if tree.tokens[c] == want), None)
        if nxt is None:
            return Acceptance(tuple(path), tuple(tree.tokens[i] for i in path) + (want,))
        path.append(nxt)
        row = nxt + 1


def _residual(p: np.ndarray, q: Optional[np.ndarray], x: int) -> np.ndarray:
    """normalise(max(0, p − q)); q ``None`` = one-hot at x, so the residual is p with x removed.

    A residual of zero mass can only be reached through rounding (rejection then has probability 0),
    so p is kept as it is.
    """
    if q is None:
        r = p.copy()
        r[x] = 0.0
    else:
        r = np.maximum(p - q, 0.0)
    total = r.sum()
    return r / total if total > 1e-12 else p


def _sample(p: np.ndarray, rng: np.random.Generator) -> int:
    """One draw from p (need not be normalised); never returns a zero-probability token.

    Inverse CDF via searchsorted: much cheaper than ``rng.choice`` (README.md, "Serving path and
    start-up times") and tolerant of rounding in sums.
    """
    return _inverse_cdf(p, rng.random())


def _inverse_cdf(p: np.ndarray, u: float) -> int:
    """The token whose CDF interval holds u in [0, 1) (p need not be normalised); never a
    zero-probability token."""
    cdf = np.cumsum(p)
    i = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    if i >= p.size:  # u * total rounded up to total: take the last token with mass
        i = int(np.flatnonzero(p)[-1])
    return i
