"""Tree budgets: how many draft nodes (and how deep) each request of a step may get.

The math is the chain model of speculative decoding: a chain of d draft tokens whose tokens are
each accepted with probability α commits on average

    E[τ | α, d] = 1 + α + α² + … + α^d = (1 − α^(d+1)) ÷ (1 − α)

tokens, so the k-th draft node of a request is worth α^k expected tokens. Given a step of n
requests and a measured step cost c(batch, tokens), adding a node worth g improves goodput
(tokens per second, T ÷ C) exactly when g > T · c′ ÷ C, with c′ the marginal cost of one more
token. `tree_budgets` finds that threshold θ by a short fixed-point iteration and gives request i
every node worth at least θ: d_i = ⌊ln θ ÷ ln α_i⌋, capped by the per-request limits and scaled
down to the step's spare token budget.

NOTE: the budget is computed with the chain model; drafters are free to spend `max_nodes` as a
tree (width) within `max_depth`. A request whose α̂ is low gets 0 nodes: plain decoding.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

from workers.drafters.base import TreeBudget
from workers.speculation import expected_tau

StepCost = Callable[[int, int], float]   # (batch size, total tree tokens) -> seconds


def _depths(alphas: Sequence[float], theta: float, cap: int) -> list[int]:
    log_theta = math.log(theta)
    out = []
    for a in alphas:
        if a <= theta:
            out.append(0)
        elif a >= 0.999:
            out.append(cap)
        else:
            out.append(min(cap, int(log_theta / math.log(a))))
    return out


def goodput_threshold(alphas: Sequence[float], step_cost: StepCost | None, cap: int,
                      min_gain: float = 0.1, iterations: int = 3) -> float:
    """θ: the least expected tokens a draft node must be worth to raise the step's goodput."""
    n = len(alphas)
    if step_cost is None or n == 0:
        return min_gain
    theta, tokens, total = min_gain, n, float(n)   # no drafts yet: each request commits one
    for _ in range(iterations):
        cost = step_cost(n, tokens)
        marginal = step_cost(n, tokens + n) - cost   # one more node for every request
        theta = max(min_gain, total * marginal / (n * cost)) if cost > 0 else min_gain
        depths = _depths(alphas, min(theta, 0.999), cap)
        tokens = n + sum(depths)
        total = sum(expected_tau(a, d) for a, d in zip(alphas, depths))
    return min(theta, 0.999)


def tree_budgets(alphas: Sequence[float], spare_tokens: int, *, max_nodes: int = 8,
                 max_depth: int = 8, step_cost: StepCost | None = None,
                 min_gain: float = 0.1, theta: float | None = None) -> list[TreeBudget]:
    """One TreeBudget per request (same order as `alphas`, each request's α estimate).

    spare_tokens: the step's token budget minus one root token per request.
    step_cost:    measured cost model; without one, every node worth ≥ min_gain is given.
    theta:        a precomputed goodput threshold (skips `goodput_threshold`).

    >>> tree_budgets([0.8, 0.5, 0.05], spare_tokens=100, min_gain=0.2)
    [TreeBudget(max_nodes=7, max_depth=7), TreeBudget(max_nodes=2, max_depth=2), TreeBudget(max_nodes=0, max_depth=0)]
    >>> sum(b.max_nodes for b in tree_budgets([0.9] * 4, spare_tokens=6))
    6
    """
    if not alphas:
        return []
    cap = max(0, min(max_nodes, spare_tokens))
    if theta is None:
        theta = goodput_threshold(alphas, step_cost, cap, min_gain)
    depths = _depths(alphas, theta, cap)
    if sum(depths) > spare_tokens:
        depths = _shrink(depths, alphas, spare_tokens)
    return [TreeBudget(d, min(d, max_depth)) for d in depths]


class TreeBudgeter:
    """`tree_budgets` for the planner, fast: the goodput threshold θ is memoized per (batch size,
    mean α rounded to 1/20, cap), computed as if every request had the batch's mean α, and each
    request's depth is read from a table over α rounded down to 1/40. Deterministic."""

    RESOLUTION = 40

    def __init__(self, step_cost: StepCost | None = None, *, max_nodes: int = 8,
                 max_depth: int = 8, min_gain: float = 0.1) -> None:
        self.step_cost, self.max_nodes, self.max_depth = step_cost, max_nodes, max_depth
        self.min_gain = min_gain
        self._tables: dict[tuple[int, int, int], list[TreeBudget]] = {}

    def _table(self, n: int, bucket: int, cap: int) -> list[TreeBudget]:
        theta = goodput_threshold([bucket / 20] * n, self.step_cost, cap, self.min_gain)
        r = self.RESOLUTION
        alphas = [i / r for i in range(r)] + [0.999]
        return [TreeBudget(d, min(d, self.max_depth)) for d in _depths(alphas, theta, cap)]

    def __call__(self, alphas: Sequence[float], spare_tokens: int) -> list[TreeBudget]:
        n = len(alphas)
        if n == 0:
            return []
        cap = max(0, min(self.max_nodes, spare_tokens))
        key = (n, round(20 * sum(alphas) / n), cap)
        table = self._tables.get(key)
        if table is None:
            table = self._tables[key] = self._table(*key)
        r = self.RESOLUTION
        out = [table[int(a * r)] for a in alphas]
        if n * cap > spare_tokens and sum(b.max_nodes for b in out) > spare_tokens:
            depths = _shrink([b.max_nodes for b in out], alphas, spare_tokens)
            out = [TreeBudget(d, min(d, self.max_depth)) for d in depths]
        return out


def _shrink(depths: list[int], alphas: Sequence[float], spare: int) -> list[int]:
    """Scale depths down to `spare` nodes in all; leftover nodes go to the highest α first."""
    used = sum(depths)
    out = [d * spare // used for d in depths]
    left = spare - sum(out)
    if left:
        for i in sorted(range(len(out)), key=lambda j: -alphas[j]):
            if left == 0:
                break
            if out[i] < depths[i]:
                out[i] += 1
                left -= 1
    return out
