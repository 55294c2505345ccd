"""Tree sizing: how many draft nodes (and how deep) each request of a step gets. The one owner.

Everything that decides how much to speculate lives here, with one model of each quantity:

- **α, one estimator** (`AlphaEstimate`, `observe`): a request's per-token acceptance, learned
  from its own steps. Every accepted token is a success; a step whose walk stopped before the
  end of its path is one failure (the geometric likelihood); counts decay (0.85 a step, ~7 steps
  of memory) so the estimate follows the text (prompt lookup is bursty: long copied runs, then
  free text), and start from a prior worth 4 steps' evidence. While a request drafts nothing
  there is no evidence, so its counts relax towards the prior and it probes again after a while;
  a probe that accepts nothing makes the next one wait twice as long. A step that proposed
  nothing is no evidence.
- **the prior, learned** (`DrafterPrior`, `pool`): what the same tenant's earlier requests showed
  of the same drafter, pooled over their steps (decayed per request-step, ~100 of memory): its α,
  and its drafting time. A new request starts from it (`DrafterPrior.start`) instead of from
  nothing: the prior α, and a drafting time the planner knows before the first probe. Until a
  tenant's requests have drafted, the prior is 3 : 1 (the n-gram drafter proposes only where its
  context matched, itself evidence of copying) and drafting is free. Why: with a fixed prior
  every new request probed a draft model whose acceptance on this traffic the planner had
  already measured, and under load (8 streams) those probes were what speculation cost over
  plain decoding (README, "SPIRe drafts").
- **drafting time** (`observe_draft_time`): seconds a request's drafter spends per tree level,
  a decayed average (~0 for n-gram and suffix drafters; a draft-model pass per level for a model
  drafter), so deep trees from a slow drafter are paid for (SPIRe's TM = τ ÷ ((k·t_draft +
  t_verify) ÷ t_target)).
- **step cost**: `StepCost(batch, tree tokens) -> seconds`, the profile measured once at
  start-up (workers/speculation/profiling.py, read by scheduler/profile.py).
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

import math
from dataclasses import dataclass, replace
from typing import Callable, Sequence

from workers.contract import NO_SPECULATION, TreeBudget

__all__ = ["StepCost", "AlphaEstimate", "DrafterPrior", "SizingConfig", "expected_tau", "observe",
           "observe_draft_time", "learn", "pool", "size_trees", "TreeSizer", "urgency"]

StepCost = Callable[[int, int], float]   # (batch size, total tree tokens) -> seconds

# The α estimator's constants (module docstring). On the copy and extract workloads a prior of
# 3 : 1 decoded faster than 2 : 1 (README, "Tree budgets").
PRIOR_ACCEPTED = 3.0
PRIOR_REJECTED = 1.0
PRIOR_WEIGHT = PRIOR_ACCEPTED + PRIOR_REJECTED   # a request's prior counts as this many steps
DECAY = 0.85          # weight kept by old evidence per step
IDLE_RELAX = 0.95     # per step without drafts, evidence relaxes towards the prior by this factor
POOL_DECAY = 0.99     # weight a tenant's pooled evidence keeps per request-step that drafted
# A learned prior never starts a request below an even chance: its own text may differ from its
# tenant's past (a copy-heavy request after chat), and a request that never drafts never learns
# otherwise. What keeps it from probing under load is the drafting time it starts knowing.
PRIOR_FLOOR = 0.5


@dataclass(frozen=True)
class AlphaEstimate:
    """Decayed evidence about one request's per-token acceptance (prior counts excluded)."""
    accepted: float = 0.0
    rejected: float = 0.0
    misses: int = 0           # drafting steps in a row that accepted nothing
    draft_s: float = 0.0      # measured drafting seconds per tree level (0: none measured yet)
    prior: float = PRIOR_ACCEPTED / PRIOR_WEIGHT   # the α it started from (`DrafterPrior`)

    @property
    def alpha(self) -> float:
        """α̂, the prior (worth PRIOR_WEIGHT steps) included.

        >>> AlphaEstimate().alpha, AlphaEstimate(accepted=3, rejected=1).alpha
        (0.75, 0.75)
        >>> AlphaEstimate(prior=0.25).alpha, AlphaEstimate(accepted=4, rejected=0, prior=0.25).alpha
        (0.25, 0.625)
        """
        return (self.accepted + self.prior * PRIOR_WEIGHT) / (self.accepted + self.rejected + PRIOR_WEIGHT)


@dataclass(frozen=True)
class DrafterPrior:
    """A tenant's evidence about one drafter, pooled over its requests' steps (prior excluded):
    where its new requests start (module docstring)."""
    accepted: float = 0.0
    rejected: float = 0.0
    draft_s: float = 0.0      # drafting seconds per tree level (0: none measured yet)

    @property
    def alpha(self) -> float:
        """The pooled α, the fixed prior included.

        >>> DrafterPrior().alpha, DrafterPrior(accepted=37, rejected=59).alpha
        (0.75, 0.4)
        """
        return (self.accepted + PRIOR_ACCEPTED) / (self.accepted + self.rejected + PRIOR_WEIGHT)

    def start(self) -> AlphaEstimate:
        """A new request's estimate: no evidence of its own yet; the pooled α, at least PRIOR_FLOOR.

        >>> DrafterPrior(accepted=37, rejected=59, draft_s=0.002).start().alpha
        0.5
        >>> DrafterPrior(accepted=77, rejected=19).start().alpha
        0.8
        """
        return AlphaEstimate(draft_s=self.draft_s, prior=max(self.alpha, PRIOR_FLOOR))


def pool(prior: DrafterPrior, drafted: int, accepted: int, draft_s: float,
         draft_depth: int) -> DrafterPrior:
    """The pooled evidence after one request-step: counted as `observe` counts a request's (every
    accepted token a success, a walk that stopped short one failure), and its drafting time
    blended as `observe_draft_time` blends it. A step that drafted nothing is no evidence.

    >>> p = pool(DrafterPrior(), 8, 3, 0.012, 3)
    >>> p.accepted, p.rejected, round(p.draft_s, 4)
    (3.0, 1.0, 0.004)
    >>> pool(p, 0, 0, 0.0, 0) == p
    True
    """
    if drafted <= 0:
        return prior
    failed = _failures(drafted, accepted)
    timed = (observe_draft_time(AlphaEstimate(draft_s=prior.draft_s), draft_s, draft_depth).draft_s
             if draft_s > 0 else prior.draft_s)                  # as `learn`: untimed steps keep it
    return DrafterPrior(prior.accepted * POOL_DECAY + accepted, prior.rejected * POOL_DECAY + failed, timed)


def _failures(drafted: int, accepted: int) -> float:
    """A step's failures: a path that ended because the tree ended (all accepted) is none;
    otherwise the target rejected the next draft, one. For a tree, `accepted == drafted` only
    when it was a chain."""
    return 0.0 if accepted == drafted else 1.0


def observe(est: AlphaEstimate, drafted: int, accepted: int) -> AlphaEstimate:
    """The estimate after a step that verified `drafted` draft nodes and accepted `accepted`.

    Worked example: from no evidence, a step that drafted 8 and accepted 3 adds 3 successes and
    1 failure: α̂ = (3 + 3) ÷ (4 + 4) = 0.75. A step that drafted nothing relaxes the evidence
    towards the prior instead.

    >>> e = observe(AlphaEstimate(), 8, 3)
    >>> e.alpha, e.misses
    (0.75, 0)
    >>> observe(e, 0, 0).accepted < e.accepted
    True
    """
    if drafted < 0 or not 0 <= accepted <= drafted:
        raise ValueError(f"need 0 <= accepted <= drafted, got drafted={drafted}, accepted={accepted}")
    if drafted == 0:  # nothing proposed, or speculation off: relax towards the prior
        # Each drafting step in a row that accepted nothing halves the relaxation speed, so probes
        # of a request whose text stays unpredictable grow exponentially rarer.
        relax = IDLE_RELAX ** (0.5 ** est.misses)
        return replace(est, accepted=est.accepted * relax, rejected=est.rejected * relax)
    failed = _failures(drafted, accepted)
    return replace(est, accepted=est.accepted * DECAY + accepted,
                   rejected=est.rejected * DECAY + failed,
                   misses=0 if accepted else est.misses + 1)


def observe_draft_time(est: AlphaEstimate, seconds: float, levels: int) -> AlphaEstimate:
    """The estimate after drafting `levels` tree levels took `seconds` (this request's share).

    >>> round(observe_draft_time(AlphaEstimate(), 0.012, 3).draft_s, 4)     # 4 ms a level
    0.004
    """
    if levels <= 0:
        return est
    measured = seconds / levels
    # The first measurement replaces the prior of 0; later ones blend in at the evidence decay.
    per_level = measured if est.draft_s == 0.0 else DECAY * est.draft_s + (1 - DECAY) * measured
    return replace(est, draft_s=per_level)


def learn(est: AlphaEstimate, drafted: int, accepted: int, draft_s: float,
          draft_depth: int) -> AlphaEstimate:
    """The estimate after one step, from what the worker reported for the request: its
    acceptance, and its drafting time when drafting was timed.

    >>> learn(AlphaEstimate(), 8, 3, 0.012, 3) == observe_draft_time(observe(AlphaEstimate(), 8, 3), 0.012, 3)
    True
    """
    est = observe(est, drafted, accepted)
    return observe_draft_time(est, draft_s, draft_depth) if draft_s > 0 else est


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


def _caps(n: int, caps: Sequence[int | None] | None, config: SizingConfig, spare: int) -> list[int]:
    limit = max(0, min(config.max_tree_tokens, spare))
    if caps is None:
        return [limit] * n
    return [limit if c is None else max(0, min(limit, c)) for c in caps]


def _budgets(depths: Sequence[int], alphas: Sequence[float], spare: int,
             max_depth: int) -> list[TreeBudget]:
    if sum(depths) > spare:
        depths = _shrink(list(depths), alphas, spare)
    return [TreeBudget(d, min(d, max_depth)) if d else NO_SPECULATION for d in depths]


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
    >>> flat = lambda b, t: 0.040 + 0.001 * t
    >>> size_trees([0.8], 64, cost=flat, config=SizingConfig(max_tree_tokens=16, max_depth=16))
    [TreeBudget(max_nodes=10, max_depth=10)]
    >>> size_trees([0.8], 64, cost=lambda b, t: 0.04 * t)
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
        if not _pays(alphas, [0.0] * n, depths, self.cost, self.config.min_goodput_gain):
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
