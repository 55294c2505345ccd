"""Per-request speculation sizing: draft as deep as pays, down to zero when nothing does.

A verification pass over n tree nodes costs `cost(n)` plain one-token passes, measured on the
machine at start-up (`workers.step_cost.measure_step_costs`). On a 2-core CPU in float32 the curve
is steep — 16 nodes cost ~1.7x a plain pass, 32 ~2.2x, 64 ~4x — so a tree pays only when enough
of it is accepted, and how deep to go depends on the request's acceptance.

Model: the drafter's tokens along the path are accepted one after another, each with probability
`a` (the request's per-token acceptance). A chain of depth d then commits, in expectation,

    E[tau](d) = 1 + a + a^2 + ... + a^d          (the 1 is the bonus token)

and the step's goodput relative to plain decoding is E[tau](d) / (cost(d) + d * t_draft), where
t_draft is what drafting one more level costs the request, in plain passes (SPIRe's TM = tau ÷
((k·t_draft + t_verify) ÷ t_target)): ~0 for n-gram and suffix drafters, one draft-model pass per
level for a model drafter (`record_draft_time` keeps a decayed measurement per request). Each step
picks the d that maximises it (d = 0, no drafting, has goodput 1 by definition), within the
planner's budget.

`a` is estimated per request from what its own steps accepted: every accepted token is a success,
a step that stopped before the end of its path is one failure (the geometric likelihood), with
counts that decay so the estimate follows the text (prompt lookup is bursty: long copied runs,
then free text). While speculation is off there is no evidence, so the counts relax towards the
prior and the request probes again after a while; a probe that fails pushes it back down and
makes the next probe wait twice as long.
A step where the drafter proposed nothing is no evidence either way.

Everything is pure: `next_budget(state, base)` and `record(state, drafted, accepted)` return new
values; the state is a small frozen dataclass kept with the request.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field, replace

from workers.drafters.base import NO_SPECULATION, TreeBudget

__all__ = ["CPU_FP32_STEP_COST", "SpeculationConfig", "SpeculationState", "expected_tau", "best_depth",
           "step_cost", "next_budget", "record", "record_draft_time"]

# (tree nodes, cost of the pass ÷ cost of a plain 1-token pass), SmolLM2-135M, fp32, 2 threads, on
# a 2-core Intel Xeon (AVX-512) with the lean forward's pre-packed weights, 2026-12-01 (`specgate
# bench profile`). A default only: engines measure their own curve at start-up.
CPU_FP32_STEP_COST: tuple[tuple[int, float], ...] = (
    (0, 1.0), (1, 1.01), (3, 1.23), (7, 1.47), (15, 1.73), (31, 2.2), (63, 4.0))


@dataclass(frozen=True)
class SpeculationConfig:
    step_cost: tuple[tuple[int, float], ...] = CPU_FP32_STEP_COST
    # Prior pseudo-counts: a = 3/4 before any evidence. The drafter only proposes where its
    # context matched (an n-gram of >= 2 tokens), which is itself evidence of copying; on the copy
    # and extract workloads 3:1 gave ~1.50x over plain decoding where 2:1 gave ~1.34x (one run).
    prior_accepted: float = 3.0
    prior_rejected: float = 1.0
    decay: float = 0.85             # weight kept by old evidence per step (~7 steps of memory)
    idle_relax: float = 0.95        # per plain step, evidence relaxes towards the prior by this factor
    min_gain: float = 1.05          # speculate only when predicted goodput beats plain decoding by 5%
    # Seconds of one plain target pass on this machine (measured with the curve); None: drafting
    # time is not weighed (as if free), since it cannot be put in plain-pass units.
    plain_s: float | None = None

    def __post_init__(self) -> None:
        nodes = [n for n, _ in self.step_cost]
        if len(nodes) < 2 or nodes[0] != 0 or nodes != sorted(set(nodes)):
            raise ValueError("step_cost needs >= 2 points with increasing node counts, starting at 0")
        if not (0 < self.decay <= 1 and 0 < self.idle_relax <= 1):
            raise ValueError("decay and idle_relax must be in (0, 1]")
        if self.prior_accepted <= 0 or self.prior_rejected <= 0:
            raise ValueError("prior pseudo-counts must be > 0")


@dataclass(frozen=True)
class SpeculationState:
    """Decayed evidence about one request's per-token acceptance (prior counts excluded)."""
    config: SpeculationConfig = field(default_factory=SpeculationConfig)
    accepted: float = 0.0
    rejected: float = 0.0
    misses: int = 0     # drafting steps in a row that accepted nothing
    draft_cost: float = 0.0   # measured cost of drafting one tree level, in plain target passes

    @property
    def acceptance(self) -> float:
        c = self.config
        return (self.accepted + c.prior_accepted) / (
            self.accepted + self.rejected + c.prior_accepted + c.prior_rejected)


def step_cost(nodes: int, table: tuple[tuple[int, float], ...] = CPU_FP32_STEP_COST) -> float:
    """Cost of a pass over `nodes` tree nodes relative to a 1-token pass: linear between the points
    of `table`, extended past the last point with the last segment's slope.

    >>> step_cost(0), step_cost(2, ((0, 1.0), (4, 2.0)))
    (1.0, 1.5)
    """
    xs = [n for n, _ in table]
    i = min(max(bisect.bisect_right(xs, nodes), 1), len(table) - 1)
    (x0, y0), (x1, y1) = table[i - 1], table[i]
    return y0 + (y1 - y0) * (nodes - x0) / (x1 - x0)


def expected_tau(a: float, depth: int) -> float:
    """Expected tokens committed by a chain of `depth` drafts each accepted with probability `a`.

    >>> expected_tau(0.5, 2), expected_tau(1.0, 3), expected_tau(0.0, 5)
    (1.75, 4.0, 1.0)
    """
    return sum(a ** i for i in range(depth + 1))


def best_depth(a: float, table: tuple[tuple[int, float], ...], max_depth: int, min_gain: float = 1.0,
               draft_cost: float = 0.0) -> int:
    """The depth in [0, max_depth] with the highest predicted goodput E[tau](d) / (cost(d) +
    d * draft_cost); 0 unless some depth beats plain decoding by `min_gain`.

    >>> table = ((0, 1.0), (1, 1.6), (4, 1.8), (8, 2.1), (16, 2.5), (32, 4.6))
    >>> best_depth(0.2, table, 16), best_depth(0.8, table, 16), best_depth(0.97, table, 32)
    (0, 10, 16)

    A draft model costing 0.2 plain passes per level keeps requests shallower (10 -> 4; and on a
    flat curve, 4 -> 1 at a = 0.4):
    >>> flat = ((0, 1.0), (1, 1.01))
    >>> best_depth(0.8, table, 16, draft_cost=0.2), best_depth(0.4, flat, 8, 1.05), best_depth(0.4, flat, 8, 1.05, 0.2)
    (4, 4, 1)
    """
    best, best_gain = 0, min_gain
    tau = 1.0
    for d in range(1, max_depth + 1):
        tau += a ** d
        gain = tau / (step_cost(d, table) + d * draft_cost)
        if gain > best_gain:
            best, best_gain = d, gain
    return best


def next_budget(state: SpeculationState, base: TreeBudget) -> TreeBudget:
    """The budget for this request's next step: the goodput-best depth within `base`.

    >>> base, steep = TreeBudget(24, 16), SpeculationConfig(step_cost=((0, 1.0), (1, 1.6), (16, 2.5)))
    >>> next_budget(SpeculationState(steep, accepted=30, rejected=1), base)
    TreeBudget(max_nodes=16, max_depth=16)
    >>> next_budget(SpeculationState(steep, accepted=0, rejected=8), base)
    TreeBudget(max_nodes=0, max_depth=0)

    Where one node costs next to nothing (the default curve), even a poor request drafts one:
    >>> next_budget(SpeculationState(accepted=0, rejected=8), base)
    TreeBudget(max_nodes=1, max_depth=1)
    """
    if not base.speculates:
        return NO_SPECULATION
    cfg = state.config
    depth = best_depth(state.acceptance, cfg.step_cost, base.max_depth, cfg.min_gain, state.draft_cost)
    if depth == 0:
        return NO_SPECULATION
    # The node budget follows the depth: spare nodes let the drafter branch where its matches
    # disagree, but every node is paid for, so they stay within the depth the curve chose.
    return TreeBudget(min(base.max_nodes, depth), depth)


def record(state: SpeculationState, drafted: int, accepted: int) -> SpeculationState:
    """The state after a step that verified `drafted` tree nodes and accepted `accepted` of them.

    Worked example (prior 3/1, decay 0.85): from no evidence, a step that drafted 8 and accepted 3
    adds 3 successes and 1 failure: a = (3 + 3) / (4 + 4) = 0.75. A step that drafted nothing relaxes
    the evidence towards the prior instead.
    """
    if drafted < 0 or not 0 <= accepted <= drafted:
        raise ValueError(f"need 0 <= accepted <= drafted, got drafted={drafted}, accepted={accepted}")
    cfg = state.config
    if drafted == 0:  # nothing proposed, or speculation off: relax towards the prior
        # Each drafting step in a row that accepted nothing halves the relaxation speed, so probes
        # of a request whose text stays unpredictable grow exponentially rarer.
        relax = cfg.idle_relax ** (0.5 ** state.misses)
        return replace(state, accepted=state.accepted * relax, rejected=state.rejected * relax)
    # NOTE: a path that ended because the tree ended (all accepted) is no failure; otherwise the
    # target rejected the next draft. For a tree, `accepted == drafted` only when it was a chain.
    failed = 0.0 if accepted == drafted else 1.0
    return replace(state, accepted=state.accepted * cfg.decay + accepted,
                   rejected=state.rejected * cfg.decay + failed,
                   misses=0 if accepted else state.misses + 1)


def record_draft_time(state: SpeculationState, seconds: float, levels: int) -> SpeculationState:
    """The state after drafting `levels` tree levels took `seconds` (this request's share of the
    call). Kept as a decayed average in plain target passes; needs the config's `plain_s`.

    >>> cfg = SpeculationConfig(plain_s=0.02)
    >>> round(record_draft_time(SpeculationState(cfg), 0.012, 3).draft_cost, 3)   # 4 ms a level = 0.2
    0.2
    >>> record_draft_time(SpeculationState(), 0.012, 3).draft_cost                 # no plain_s: free
    0.0
    """
    cfg = state.config
    if cfg.plain_s is None or levels <= 0:
        return state
    measured = seconds / levels / cfg.plain_s
    # The first measurement replaces the prior of 0; later ones blend in at the evidence decay.
    cost = measured if state.draft_cost == 0.0 else cfg.decay * state.draft_cost + (1 - cfg.decay) * measured
    return replace(state, draft_cost=cost)
