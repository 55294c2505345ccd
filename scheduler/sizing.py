"""Tree sizing: how many draft nodes (and how deep) each request of a step gets. The one owner.

Everything that decides how much to speculate lives here, with one model of each quantity:

- **α and drafting time** (scheduler/alpha.py): each request's estimates, learned from its own
  steps and started from what its tenant's earlier requests showed of its drafter.
- **step cost**: `StepCost(batch, tree tokens) -> seconds` (scheduler/step_cost.py), the profile
  measured once at start-up (workers/speculation/profiling.py, read by scheduler/profile.py).
- **the sizing rule** (`size_trees`, and `TreeSizer`, its fast form for the planner): the chain
  model of speculative decoding. A chain of d draft tokens each accepted with probability α
  commits on average

      E[τ | α, d] = 1 + α + α² + … + α^d

  tokens, so a request's k-th draft node is worth α^k expected tokens. A step of n requests
  commits T tokens in C seconds (verification + drafting); one more node for request i raises
  the goodput T ÷ C roughly when α_i^k > (T ÷ C)·(c′ + δ_i), with c′ the marginal step seconds
  of one more tree token and δ_i request i's drafting seconds per level. So each request gets
  every node worth at least a threshold θ (discounted for its drafting time), the θ that gives
  the step the best goodput by the measured cost (tried exactly, not by the marginal: a measured
  curve need not be convex); within its cap
  (`max_tree_tokens`, the tenant's or request's, 0 for no speculation) and the step's spare
  token budget. Finally the step as sized must beat plain decoding's goodput by
  `min_goodput_gain`, or nobody drafts: a request whose α is low gets 0 nodes, plain decoding.

NOTE: the budget is sized with the chain model; drafters are free to spend `max_nodes` as a tree
(width) within `max_depth`.

**Latency-aware node values** (`urgency`, LAPS-SD's `node_urgency`; off). A node for a request
about to finish is worth more to mean latency than one for a request with hundreds of tokens to
go, so the policy can weight each request's node worths by (r̄ ÷ r_i)^strength, r_i its predicted
remaining steps, and the search then maximises the weighted goodput. Measured in `specgate sim`
(README.md, "Length prediction and LAPS-SD"), it raised mean latency in every regime tried, most
near capacity: nodes moved away from the goodput optimum cost throughput, and near capacity the
waiting every request does grows with any loss of throughput, far more than the one request
moved ahead gains; at light load the batch is small and the caps bind, so there is nothing to
move. Kept as an option so the measurement can be repeated, not used by default.

Workers carry out the budgets they are handed and report what they drafted, accepted and how
long drafting took (`workers.contract.StepResult`); they never size. Pure: no I/O, no torch.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence

from scheduler.step_cost import StepCost
from workers.contract import NO_SPECULATION, TreeBudget

__all__ = ["SizingConfig", "expected_tau", "size_trees", "TreeSizer", "urgency"]

@dataclass(frozen=True)
class SizingConfig:
    max_tree_tokens: int = 8      # draft nodes per request per step, at most (the deployment's cap)
    max_depth: int = 8
    min_node_gain: float = 0.1    # a draft node must be worth at least this many tokens
    # Speculate only where the step's predicted goodput beats plain decoding's by this factor
    # (the cost profile is measured, so its noise must not turn a wash into a loss).
    min_goodput_gain: float = 1.05

    def __post_init__(self) -> None:
        if self.max_tree_tokens < 0 or self.max_depth < 0:
            raise ValueError("max_tree_tokens and max_depth must be >= 0")


def expected_tau(a: float, depth: int) -> float:
    """Expected tokens committed by a chain of `depth` drafts each accepted with probability `a`.

    >>> expected_tau(0.5, 2), expected_tau(1.0, 3), expected_tau(0.0, 5)
    (1.75, 4.0, 1.0)
    """
    if a >= 1.0:
        return depth + 1.0
    return (1.0 - a ** (depth + 1)) / (1.0 - a)


def _depth(a: float, theta: float, cap: int) -> int:
    """Nodes worth at least θ: the k with α^k ≥ θ, at most `cap`."""
    if cap <= 0 or a <= theta:
        return 0
    if a >= 0.999 or theta <= 0:
        return cap
    return min(cap, int(math.log(theta) / math.log(a)))


def _goodput(alphas: Sequence[float], draft_s: Sequence[float], depths: Sequence[int],
             cost: StepCost, weights: Sequence[float] | None = None) -> float:
    """Expected tokens per second of a step with these depths: E[τ] summed ÷ (verification +
    drafting seconds); with `weights`, each request's tokens weighted (urgency)."""
    n = len(alphas)
    seconds = cost(n, n + sum(depths)) + sum(d * s for d, s in zip(depths, draft_s))
    if weights is None:
        tokens = sum(expected_tau(a, d) for a, d in zip(alphas, depths))
    else:
        tokens = sum(w * expected_tau(a, d) for a, d, w in zip(alphas, depths, weights))
    return tokens / seconds if seconds > 0 else 0.0


def _search(alphas: Sequence[float], draft_s: Sequence[float], caps: Sequence[int],
            cost: StepCost | None, min_gain: float,
            urgency: Sequence[float] | None = None) -> tuple[list[int], float]:
    """(depths, θ): the step's best goodput over the family "every node worth at least θ".

    A node's worth is its expected tokens, α^k, discounted for its request's drafting time by
    c̄ ÷ (c̄ + δ_i), c̄ the mean marginal step seconds of a tree token. Every worth a node of the
    step can have is tried as θ, from the fewest nodes to the most, and the step's goodput is
    evaluated exactly: a measured cost curve need not be convex (on CPUs the first node of a
    tree can cost most), so following the marginal cost from zero nodes can stop short.
    """
    n = len(alphas)
    u = [1.0] * n if urgency is None else list(urgency)
    if cost is None:
        return [_depth(a, min_gain / w, c) for a, w, c in zip(alphas, u, caps)], min_gain
    top = max(caps, default=0)
    if top == 0:
        return [0] * n, 1.0
    per_token = max(0.0, (cost(n, n + n * top) - cost(n, n)) / (n * top))
    scale = [w * per_token / (per_token + s) if per_token + s > 0 else w
             for s, w in zip(draft_s, u)]
    # a request whose nodes are worth nothing here (a cost curve flat over the tree sizes, so
    # any drafting time outweighs them: scale 0) drafts no tree at any θ
    worths = sorted({a ** k * w for a, w, c in zip(alphas, scale, caps)
                     for k in range(1, c + 1) if a ** k > min_gain and w > 0}, reverse=True)
    best, best_rate, best_theta = [0] * n, _goodput(alphas, draft_s, [0] * n, cost, urgency), 1.0
    for theta in worths:
        t = theta * (1 - 1e-9)                     # node k of a request worth exactly θ is in
        depths = [_depth(a, max(min_gain, t / w), c) if w > 0 else 0
                  for a, w, c in zip(alphas, scale, caps)]
        rate = _goodput(alphas, draft_s, depths, cost, urgency)
        if rate > best_rate * (1 + 1e-12):
            best, best_rate, best_theta = depths, rate, t
    return best, min(best_theta, 0.999)


def _pays(alphas: Sequence[float], draft_s: Sequence[float], depths: Sequence[int],
          cost: StepCost | None, min_goodput_gain: float) -> bool:
    """Whether the step as sized beats plain decoding's goodput by `min_goodput_gain`."""
    if cost is None or not any(depths):
        return True
    plain = _goodput(alphas, draft_s, [0] * len(alphas), cost)
    return _goodput(alphas, draft_s, depths, cost) >= min_goodput_gain * plain


def _pays_undrafted(alphas: Sequence[float], depths: Sequence[int], cost: StepCost | None,
                    min_goodput_gain: float) -> bool:
    """`_pays` for requests that draft in no time (`TreeSizer`'s fast path), exactly: plain
    decoding commits one token a request (`expected_tau(α, 0)` is 1 for every α), so its
    goodput needs no pass over the batch, and no drafting seconds are added to either step."""
    if cost is None or not any(depths):
        return True
    n = len(alphas)
    seconds, plain_s = cost(n, n + sum(depths)), cost(n, n)
    sized = sum(map(expected_tau, alphas, depths)) / seconds if seconds > 0 else 0.0
    plain = n / plain_s if plain_s > 0 else 0.0
    return sized >= min_goodput_gain * plain


def _caps(n: int, caps: Sequence[int | None] | None, config: SizingConfig, spare: int) -> list[int]:
    limit = max(0, min(config.max_tree_tokens, spare))
    if caps is None:
        return [limit] * n
    return [limit if c is None else max(0, min(limit, c)) for c in caps]


def _budgets(depths: Sequence[int], alphas: Sequence[float], spare: int,
             max_depth: int) -> list[TreeBudget]:
    if sum(depths) > spare:
        depths = _shrink(list(depths), alphas, spare)
    return [_tree_budget(d, max_depth) for d in depths]


def cut_to(budgets: Sequence[TreeBudget], alphas: Sequence[float], spare: int,
           max_depth: int) -> list[TreeBudget]:
    """`budgets` cut to `spare` nodes in all as `size_trees` cuts its own (leftovers to the
    highest α); unchanged when within. What the planner uses to hold a tenant to its share.

    >>> cut_to([TreeBudget(8, 8), TreeBudget(4, 4)], [0.9, 0.5], 6, 16)
    [TreeBudget(max_nodes=4, max_depth=4), TreeBudget(max_nodes=2, max_depth=2)]
    """
    return _budgets([b.max_nodes for b in budgets], alphas, spare, max_depth)


@functools.lru_cache(maxsize=4096)
def _tree_budget(nodes: int, max_depth: int) -> TreeBudget:
    """The budget of a tree of `nodes` nodes: one per (nodes, max_depth) for the process, shared
    (it is frozen): building and validating one per request was a measurable part of a plan."""
    return TreeBudget(nodes, min(nodes, max_depth)) if nodes else NO_SPECULATION


def size_trees(alphas: Sequence[float], spare_tokens: int, *, cost: StepCost | None = None,
               config: SizingConfig = SizingConfig(), draft_s: Sequence[float] | None = None,
               caps: Sequence[int | None] | None = None,
               urgency: Sequence[float] | None = None) -> list[TreeBudget]:
    """One TreeBudget per request of a step (in the order of `alphas`, their α estimates).

    spare_tokens: the step's token budget minus one root token per request.
    cost:         the measured step-cost model; without one, every node worth ≥ min_node_gain.
    draft_s:      each request's drafting seconds per tree level (default: free).
    caps:         each request's own cap on nodes (None: the config's; 0: no speculation).
    urgency:      each request's weight on its nodes' worth (the policy's; see `urgency`).

    >>> size_trees([0.8, 0.5, 0.05], spare_tokens=100, config=SizingConfig(min_node_gain=0.2))
    [TreeBudget(max_nodes=7, max_depth=7), TreeBudget(max_nodes=2, max_depth=2), TreeBudget(max_nodes=0, max_depth=0)]
    >>> sum(b.max_nodes for b in size_trees([0.9] * 4, spare_tokens=6))
    6
    >>> size_trees([0.9, 0.9], spare_tokens=100, caps=[0, 3])
    [TreeBudget(max_nodes=0, max_depth=0), TreeBudget(max_nodes=3, max_depth=3)]

    With a step cost, a node must pay for itself: a flat cost gives deep trees, a cost that
    grows as fast as the tokens do gives none, and a slow drafter keeps trees shallow.
    >>> from scheduler.step_cost import LinearStepCost
    >>> flat = LinearStepCost(fixed_s=0.040, per_token_s=0.001)
    >>> size_trees([0.8], 64, cost=flat, config=SizingConfig(max_tree_tokens=16, max_depth=16))
    [TreeBudget(max_nodes=10, max_depth=10)]
    >>> size_trees([0.8], 64, cost=LinearStepCost(per_token_s=0.04))
    [TreeBudget(max_nodes=0, max_depth=0)]
    >>> size_trees([0.8], 64, cost=flat, draft_s=[0.008], config=SizingConfig(max_tree_tokens=16, max_depth=16))
    [TreeBudget(max_nodes=4, max_depth=4)]
    """
    n = len(alphas)
    if n == 0:
        return []
    draft_s = [0.0] * n if draft_s is None else list(draft_s)
    limits = _caps(n, caps, config, spare_tokens)
    depths, _ = _search(alphas, draft_s, limits, cost, config.min_node_gain, urgency)
    if not _pays(alphas, draft_s, depths, cost, config.min_goodput_gain):
        return [NO_SPECULATION] * n
    return _budgets(depths, alphas, spare_tokens, config.max_depth)


class TreeSizer:
    """`size_trees` for the planner, fast: where no request has a measured drafting time (n-gram
    and suffix drafters), the goodput threshold is memoized per (batch size, mean α rounded to
    1/20, cap), computed as if every request had the batch's mean α; each request's depth then
    takes one logarithm. Deterministic. Requests with drafting times are sized exactly."""

    def __init__(self, cost: StepCost | None = None, config: SizingConfig = SizingConfig()) -> None:
        self.cost, self.config = cost, config
        self._thetas: dict[tuple[int, int, int], float] = {}

    def __call__(self, alphas: Sequence[float], spare_tokens: int, *,
                 draft_s: Sequence[float] | None = None,
                 caps: Sequence[int | None] | None = None,
                 urgency: Sequence[float] | None = None) -> list[TreeBudget]:
        n = len(alphas)
        if n == 0:
            return []
        if draft_s is not None and any(draft_s):
            return size_trees(alphas, spare_tokens, cost=self.cost, config=self.config,
                              draft_s=draft_s, caps=caps, urgency=urgency)
        limits = _caps(n, caps, self.config, spare_tokens)
        theta = self._theta(n, round(20 * sum(alphas) / n), max(limits))
        if urgency is None:
            depths = [_depth(a, theta, c) for a, c in zip(alphas, limits)]
        else:
            depths = [_depth(a, theta / w, c) for a, w, c in zip(alphas, urgency, limits)]
        if not _pays_undrafted(alphas, depths, self.cost, self.config.min_goodput_gain):
            return [NO_SPECULATION] * n
        return _budgets(depths, alphas, spare_tokens, self.config.max_depth)

    def _theta(self, n: int, bucket: int, cap: int) -> float:
        key = (n, bucket, cap)
        theta = self._thetas.get(key)
        if theta is None:
            theta = self._thetas[key] = _threshold([bucket / 20] * n, cap, self.cost,
                                                   self.config.min_node_gain)
        return theta


def urgency(remaining_steps: Sequence[float], strength: float, bound: float = 4.0) -> list[float]:
    """Weights on a step's node worths from each request's predicted remaining steps: the
    request nearer its end gets (r̄ ÷ r_i)^strength, r̄ the step's geometric mean, within
    [1/bound, bound]. Pure.

    >>> [round(u, 2) for u in urgency([10, 40], 0.5)]
    [1.41, 0.71]
    >>> urgency([10, 40], 0.0)
    [1.0, 1.0]
    """
    logs = [math.log(max(r, 1e-3)) for r in remaining_steps]
    mean = sum(logs) / len(logs)
    return [min(bound, max(1.0 / bound, math.exp(strength * (mean - x)))) for x in logs]


def _threshold(alphas: Sequence[float], cap: int, cost: StepCost | None, min_gain: float) -> float:
    """θ for a batch of requests without drafting time."""
    return _search(alphas, [0.0] * len(alphas), [cap] * len(alphas), cost, min_gain)[1]


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
