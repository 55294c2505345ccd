"""Per-request speculation backoff: shrink the tree when it does not pay, probe, grow back.

A step over a tree costs more than a plain one-token step, so speculation only pays when enough is
accepted. On CPU fp32 (FINDINGS.md) a pass over a 16-node tree costs ≈ 2× a 1-token pass, so a tree
must average well above ~1 accepted token per step to win; a short chain of ≤ 4 nodes costs
~1.3–1.9×. The planner picks a ``base`` budget; this controller only guards each request against
being slower than plain decoding:

* Over a window of recent steps that drafted something, estimate the speedup
  Σ(1 + accepted) ÷ Σ cost(drafted) (τ per unit of step cost). Below ``shrink_below`` the node cap
  halves (depth ≤ nodes); a window with nothing accepted at all goes straight to zero, since a
  smaller best-first tree cannot accept more than a bigger one.
* At zero, every step is plain decoding; after ``probe_after`` steps the controller allows one small
  tree (``probe_nodes``). A probe that does not pay doubles the wait (up to ``max_probe_after``), so
  a request whose text stays unpredictable pays a vanishing price; one whose text becomes
  predictable regains speculation.
* When the window's τ would still pay for a tree twice the current cap (at twice the cost), the cap
  doubles, back up to ``base``.
* A step whose drafter proposed nothing (empty tree) cost nothing extra and is no rejection: it is
  not evidence, it only counts toward the wait for a probe.

Everything is pure: ``next_budget(state, base)`` and ``record(state, drafted, accepted)`` return new
values; the state is a frozen dataclass the scheduler keeps with the request.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field, replace
from typing import Optional

from workers.drafters.base import NO_SPECULATION, TreeBudget

__all__ = [
    "CPU_FP32_STEP_COST",
    "SpeculationConfig",
    "SpeculationState",
    "step_cost",
    "next_budget",
    "record",
]

# (tree nodes, cost of the verification pass ÷ cost of a plain 1-token pass), SmolLM2-135M, fp32,
# 2 CPU threads (FINDINGS.md; a pass over n nodes feeds n + 1 tokens: the root and the nodes).
# Planners that measure their own step cost (GPU, bf16, batch size) pass their own table.
CPU_FP32_STEP_COST: tuple[tuple[int, float], ...] = ((0, 1.0), (1, 1.3), (4, 1.8), (8, 1.9), (16, 2.0), (64, 3.5))


@dataclass(frozen=True)
class SpeculationConfig:
    window: int = 4  # steps that drafted something, per decision
    shrink_below: float = 1.0  # estimated speedup under which the tree shrinks
    grow_above: float = 1.2  # estimated speedup of a twice-as-big tree needed to grow
    probe_after: int = 8  # plain steps at zero before the first probe
    probe_growth: float = 2.0  # each failed probe multiplies the wait
    max_probe_after: int = 512
    probe_nodes: int = 2
    step_cost: tuple[tuple[int, float], ...] = CPU_FP32_STEP_COST

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        if self.probe_after < 0 or self.max_probe_after < self.probe_after:
            raise ValueError("need 0 <= probe_after <= max_probe_after")
        if self.probe_growth < 1:
            raise ValueError(f"probe_growth must be >= 1, got {self.probe_growth}")
        if self.probe_nodes < 1:
            raise ValueError(f"probe_nodes must be >= 1, got {self.probe_nodes}")
        nodes = [n for n, _ in self.step_cost]
        if len(nodes) < 2 or nodes[0] != 0 or nodes != sorted(set(nodes)):
            raise ValueError("step_cost needs >= 2 points with increasing node counts, starting at 0")


@dataclass(frozen=True)
class SpeculationState:
    """One request's controller state.

    ``cap``: node cap on the planner's base budget; ``None`` = no cap (the base), ``0`` = off.
    ``recent``: (drafted, accepted) of the latest steps that drafted, since the cap last changed.
    ``idle_steps``: plain steps since speculation went off. ``failed_probes``: probes in a row that
    did not pay. ``probing``: the current cap comes from a probe not yet judged.
    """

    config: SpeculationConfig = field(default_factory=SpeculationConfig)
    cap: Optional[int] = None
    recent: tuple[tuple[int, int], ...] = ()
    idle_steps: int = 0
    failed_probes: int = 0
    probing: bool = False

    @property
    def probe_wait(self) -> int:
        """Plain steps to wait at zero before the next probe."""
        c = self.config
        return int(min(c.max_probe_after, c.probe_after * c.probe_growth**self.failed_probes))


def step_cost(nodes: int, table: tuple[tuple[int, float], ...] = CPU_FP32_STEP_COST) -> float:
    """Cost of a pass over ``nodes`` tree nodes relative to a 1-token pass: linear between the points
    of ``table``, extended past the last point with the last segment's slope.

    >>> step_cost(16), round(step_cost(2), 3), step_cost(112)
    (2.0, 1.467, 5.0)
    """
    xs = [n for n, _ in table]
    i = min(max(bisect.bisect_right(xs, nodes), 1), len(table) - 1)
    (x0, y0), (x1, y1) = table[i - 1], table[i]
    return y0 + (y1 - y0) * (nodes - x0) / (x1 - x0)


def next_budget(state: SpeculationState, base: TreeBudget) -> TreeBudget:
    """The budget for this request's next step: ``base`` under the state's cap (or a probe).

    >>> base = TreeBudget(16, 6)
    >>> next_budget(SpeculationState(), base), next_budget(SpeculationState(cap=4), base)
    (TreeBudget(max_nodes=16, max_depth=6), TreeBudget(max_nodes=4, max_depth=4))
    >>> next_budget(SpeculationState(cap=0), base)  # off, probe not due yet
    TreeBudget(max_nodes=0, max_depth=0)
    """
    if state.cap == 0:
        if state.idle_steps < state.probe_wait:
            return NO_SPECULATION
        nodes = min(base.max_nodes, state.config.probe_nodes)
    else:
        nodes = base.max_nodes if state.cap is None else min(base.max_nodes, state.cap)
    if nodes == 0:
        return NO_SPECULATION
    return TreeBudget(nodes, min(base.max_depth, nodes))


def record(state: SpeculationState, drafted: int, accepted: int) -> SpeculationState:
    """The state after a step that verified ``drafted`` tree nodes and accepted ``accepted`` of them.

    Worked example (defaults: window 4, CPU cost table): four steps with 16 drafted and 0 accepted
    estimate a speedup of 4 ÷ (4 × 2.0) = 0.5 and turn speculation off; four steps with 16 drafted
    and 1 accepted each estimate 8 ÷ 8 = 1.0, which is not below ``shrink_below``, so the base stays.
    """
    if drafted < 0 or not 0 <= accepted <= drafted:
        raise ValueError(f"need 0 <= accepted <= drafted, got drafted={drafted}, accepted={accepted}")
    if drafted == 0:  # plain step: no evidence either way
        return replace(state, idle_steps=state.idle_steps + 1) if state.cap == 0 else state
    if state.cap == 0:  # this step was a probe
        state = replace(state, cap=state.config.probe_nodes, recent=(), idle_steps=0, probing=True)
    recent = (state.recent + ((drafted, accepted),))[-state.config.window :]
    if len(recent) < state.config.window:
        return replace(state, recent=recent)
    return _decide(state, recent)


def _decide(state: SpeculationState, recent: tuple[tuple[int, int], ...]) -> SpeculationState:
    """Shrink, grow or keep the cap, given a full window of evidence."""
    cfg = state.config
    gain = sum(1 + a for _, a in recent)  # tokens committed (τ summed)
    speedup = gain / sum(step_cost(d, cfg.step_cost) for d, _ in recent)
    largest = max(d for d, _ in recent)
    if speedup < cfg.shrink_below:
        size = largest if state.cap is None else min(state.cap, largest)
        nothing = all(a == 0 for _, a in recent)
        cap = 0 if (nothing or state.probing) else size // 2
        if cap == 0:
            return replace(
                state, cap=0, recent=(), idle_steps=0, probing=False,
                failed_probes=state.failed_probes + 1 if state.probing else 0,
            )
        return replace(state, cap=cap, recent=())
    # The cap binds (some step drafted up to it) and τ would pay for a tree twice as big.
    if state.cap is not None and largest >= state.cap:
        bigger = gain / (len(recent) * step_cost(2 * state.cap, cfg.step_cost))
        if bigger >= cfg.grow_above:
            return replace(state, cap=2 * state.cap, recent=(), probing=False, failed_probes=0)
    return replace(state, recent=recent, probing=False, failed_probes=0)
