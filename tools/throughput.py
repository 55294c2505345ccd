"""Throughput model: predicted tokens per second of speculative decoding for a drafter, a tree
shape, a batch size and a context length, and the multiplier over plain decoding.

SPIRe (arXiv 2504.06419) writes the multiplier of a draft-then-verify step over plain decoding as

    TM = τ ÷ ((k·t_draft + t_verify) ÷ t_target)

with τ the tokens committed per step, k·t_draft the drafting time of a step (k draft calls),
t_verify the verification pass over the tree and t_target a plain one-token pass. Here, for a
batch of n alike requests each holding c tokens of context:

    t_target  = step(n, n, c)                  plain step: one root row per request
    t_verify  = E[step(n, n + drafted nodes, c)]   the measured step-cost profile
                                                   (scheduler/profile.py), expectation below
    t_draft   = DrafterCost: a fixed part per draft call, a part per tree level (a model drafter
                runs one forward per level: SPIRe's k·t_draft for a chain of k), a part per node
    tokens/s  = n · E[τ] ÷ (t_draft + t_verify),   plain: n ÷ t_target,   TM = their ratio.

Acceptance model (`Acceptance`): three per-drafter probabilities, fitted from acceptance history
(`fit_acceptance`).

- coverage q: the drafter proposes anything at all at a step (prompt lookup only proposes where
  the context matched: q < 1; a model drafter always: q = 1). A step without a proposal is plain.
- reach ρ: a proposal goes one level deeper, given it reached this one, within the budget's depth
  (a continuation found by lookup can end early; a model drafter fills the shape: ρ = 1).
- α: a draft token is the target's token, given its parent was (the chain model of
  scheduler/sizing.py). For a chain of depth d the accepted path reaches level ℓ with
  probability q·ρ^(ℓ−1)·α^ℓ, so

      E[τ] = 1 + q·α·E_chain[τ](ρα, d − 1),     E[nodes] = q·E_chain[τ](ρ, d − 1)

  with E_chain[τ](a, d) = 1 + a + … + a^d (`scheduler.sizing.expected_tau`).

Tree shapes (`TreeShape`): a chain of depth d, or a SpecInfer width vector ⟨k1..kd⟩, every node
at level ℓ − 1 having k_ℓ children (k1 under the root), so level ℓ holds k1·…·k_ℓ nodes.
NOTE: width model: the i-th ranked sibling is the target's token with probability α(1 − α)^(i−1)
(each candidate catches an α share of what those before it missed), so a level of k siblings is
passed with probability β_k = 1 − (1 − α)^k and E[τ] = 1 + q·Σ_ℓ ρ^(ℓ−1)·β_k1·…·β_kℓ. It is
optimistic (real drafters' second choices are worse than their first: a measured per-rank
acceptance, as in Sequoia, would replace it) and reduces to the chain formula when every k = 1.

Step cost expectation: each request proposes (with probability q) or not, independently, so the
number m of proposing requests is Binomial(n, q) and E[t_verify] = Σ_m P(m)·step(n, n + m·L̄, c),
L̄ = E[nodes | proposed]. A per-request overhead (the loop's bookkeeping outside the verifier
and the drafters) can be added to every step, plain ones included.

This model predicts; it does not size trees. `ThroughputModel.best_shape` says which fixed shape
would be best for a batch alike (down to no speculation), to compare drafters and shapes offline;
serving, the simulator and `specgate generate` size every request's tree each step with the one
sizing rule of scheduler/sizing.py, whose chain model (`expected_tau`) this model shares.
`specgate plan` (tools/plan_cmd.py) prints these predictions and measures them. Pure arithmetic:
no torch, no I/O.

>>> flat = lambda batch, tokens, context=None: 0.040 + 0.001 * tokens   # a made-up profile
>>> m = ThroughputModel(flat)
>>> p = m.predict(Acceptance(0.8), TreeShape.parse("chain:4"), batch=1)
>>> round(p.tau, 3), round(p.step_s, 3), round(p.tokens_per_s, 1), round(p.multiplier, 2)
(3.362, 0.045, 74.7, 3.06)
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from workers.contract import NO_SPECULATION, TreeBudget
from scheduler.sizing import expected_tau

StepCost = Callable[..., float]     # (batch, tree tokens, context=None) -> seconds of one step


@dataclass(frozen=True)
class TreeShape:
    """Children per node at each level: () no speculation, (1,)*d a chain of depth d."""
    widths: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if any(k < 1 for k in self.widths):
            raise ValueError(f"tree widths must be ≥ 1, got {self.widths}")

    @classmethod
    def chain(cls, depth: int) -> "TreeShape":
        return cls((1,) * depth)

    @classmethod
    def parse(cls, text: str) -> "TreeShape":
        """`chain:D`, `widths:K1xK2x…` or `none` (= `chain:0`).

        >>> TreeShape.parse("widths:2x2x1").nodes, TreeShape.parse("chain:3").name
        (10, 'chain:3')
        """
        kind, _, arg = text.strip().partition(":")
        if kind == "none" and not arg:
            return cls()
        if kind == "chain" and arg.isdigit():
            return cls.chain(int(arg))
        if kind == "widths" and arg:
            return cls(tuple(int(k) for k in arg.split("x")))
        raise ValueError(f"tree shape {text!r}: use chain:D, widths:K1xK2x… or none")

    @property
    def depth(self) -> int:
        return len(self.widths)

    @property
    def is_chain(self) -> bool:
        return all(k == 1 for k in self.widths)

    @property
    def level_nodes(self) -> list[int]:
        """Nodes at each level (k1, k1·k2, …)."""
        out, n = [], 1
        for k in self.widths:
            n *= k
            out.append(n)
        return out

    @property
    def nodes(self) -> int:
        return sum(self.level_nodes)

    @property
    def name(self) -> str:
        if not self.widths:
            return "none"
        if self.is_chain:
            return f"chain:{self.depth}"
        return "widths:" + "x".join(map(str, self.widths))

    def budget(self) -> TreeBudget:
        """The budget a drafter is given for this shape (the shape itself is the drafter's)."""
        return TreeBudget(self.nodes, self.depth) if self.widths else NO_SPECULATION


@dataclass(frozen=True)
class Acceptance:
    """A drafter's acceptance on a workload (see the module docstring): α, coverage q, reach ρ."""
    alpha: float
    coverage: float = 1.0
    reach: float = 1.0

    def __post_init__(self) -> None:
        for name in ("alpha", "coverage", "reach"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")

    def tau(self, shape: TreeShape) -> float:
        """E[τ]: tokens committed per step by one request.

        >>> a = Acceptance(0.5)
        >>> a.tau(TreeShape.chain(2)), Acceptance(0.5, coverage=0.5).tau(TreeShape.chain(2))
        (1.75, 1.375)
        >>> round(a.tau(TreeShape((2, 1))), 4)                 # β2 = 0.75, then 0.75·0.5
        2.125
        """
        q, a, r = self.coverage, self.alpha, self.reach
        if not shape.widths:
            return 1.0
        if shape.is_chain:
            return 1.0 + q * a * expected_tau(r * a, shape.depth - 1)
        total, passed = 0.0, 1.0
        for level, k in enumerate(shape.widths):
            passed *= 1.0 - (1.0 - a) ** k
            total += r ** level * passed
        return 1.0 + q * total

    def proposed_nodes(self, shape: TreeShape) -> float:
        """E[nodes | the drafter proposed]: the tree's levels, each reached with probability ρ^(ℓ−1).

        >>> Acceptance(0.5, reach=0.5).proposed_nodes(TreeShape.chain(3)), TreeShape((2, 2)).nodes
        (1.75, 6)
        """
        return sum(self.reach ** level * n for level, n in enumerate(shape.level_nodes))

    def nodes(self, shape: TreeShape) -> float:
        """E[nodes] drafted per request per step."""
        return self.coverage * self.proposed_nodes(shape)


@dataclass(frozen=True)
class DrafterCost:
    """Seconds a drafter spends on one step. `batched`: one call drafts every request of the step
    (a model drafter's batched forward); otherwise one call per request (lookup drafters).

    >>> round(DrafterCost(fixed_s=1e-3, per_level_s=2e-3).step_s(batch=2, nodes=4, depth=4), 6)
    0.018
    >>> round(DrafterCost(1e-3, per_level_s=2e-3, batched=True).step_s(batch=2, nodes=4, depth=4), 6)
    0.009
    """
    fixed_s: float = 0.0
    per_node_s: float = 0.0
    per_level_s: float = 0.0
    batched: bool = False

    def step_s(self, batch: int, nodes: float, depth: int) -> float:
        """`nodes`: expected drafted nodes per request; `depth`: the tree's depth (0: no call)."""
        if depth == 0 or batch == 0:
            return 0.0
        calls = 1 if self.batched else batch
        return calls * (self.fixed_s + self.per_level_s * depth) + batch * self.per_node_s * nodes


@dataclass(frozen=True)
class Prediction:
    tau: float                  # E[τ] per request per step
    nodes: float                # E[drafted nodes] per request per step
    step_s: float               # E[t_verify]
    draft_s: float              # t_draft of the step
    plain_step_s: float         # t_target
    batch: int

    @property
    def tokens_per_s(self) -> float:
        return self.batch * self.tau / (self.step_s + self.draft_s)

    @property
    def plain_tokens_per_s(self) -> float:
        return self.batch / self.plain_step_s

    @property
    def multiplier(self) -> float:
        """SPIRe's TM: τ ÷ ((t_draft + t_verify) ÷ t_target)."""
        return self.tau / ((self.draft_s + self.step_s) / self.plain_step_s)


class ThroughputModel:
    """Predictions from a step-cost profile (`scheduler.profile.StepCostModel`, or any callable
    (batch, tokens, context) -> seconds). `overhead_s`: seconds per request per step outside the
    verifier and the drafters (the loop's own bookkeeping), paid by plain decoding too."""

    def __init__(self, step_cost: StepCost, overhead_s: float = 0.0) -> None:
        self.step_cost, self.overhead_s = step_cost, overhead_s

    def _cost(self, batch: int, tokens: float, context: int | None) -> float:
        return self.step_cost(batch, tokens, context) + self.overhead_s * batch

    def verify_s(self, acc: Acceptance, shape: TreeShape, batch: int,
                 context: int | None = None) -> float:
        """E[t_verify] over how many of the batch's requests propose (Binomial(batch, q))."""
        per = acc.proposed_nodes(shape)
        if per == 0 or acc.coverage == 0:
            return self._cost(batch, batch, context)
        if acc.coverage == 1:
            return self._cost(batch, batch * (1 + per), context)
        q = acc.coverage
        return sum(math.comb(batch, m) * q ** m * (1 - q) ** (batch - m)
                   * self._cost(batch, batch + m * per, context) for m in range(batch + 1))

    def predict(self, acc: Acceptance, shape: TreeShape, batch: int, context: int | None = None,
                drafter: DrafterCost = DrafterCost()) -> Prediction:
        """A batch of `batch` requests alike (same drafter, acceptance, shape and context)."""
        if batch < 1:
            raise ValueError(f"batch must be ≥ 1, got {batch}")
        nodes = acc.nodes(shape)
        return Prediction(tau=acc.tau(shape), nodes=nodes,
                          step_s=self.verify_s(acc, shape, batch, context),
                          draft_s=drafter.step_s(batch, nodes, shape.depth),
                          plain_step_s=self._cost(batch, batch, context), batch=batch)

    def best_shape(self, acc: Acceptance, shapes: Iterable[TreeShape], batch: int,
                   context: int | None = None, drafter: DrafterCost = DrafterCost(),
                   min_gain: float = 1.0) -> TreeShape:
        """The shape with the highest predicted tokens/s for a batch alike; no speculation (the
        empty shape) unless some shape beats plain decoding by `min_gain`.

        >>> m, a = ThroughputModel(lambda b, t, c=None: 0.04 + 0.001 * t), Acceptance(0.8)
        >>> chains = [TreeShape.chain(d) for d in (1, 2, 4, 8, 16)]
        >>> m.best_shape(a, chains, batch=1).name, m.best_shape(Acceptance(0.02), chains, batch=1).name
        ('chain:8', 'none')
        >>> m.best_shape(a, chains, batch=64).name          # 64 rows already cost 2.6 plain steps
        'chain:1'
        """
        best, best_rate = TreeShape(), self.predict(acc, TreeShape(), batch, context).tokens_per_s
        floor = best_rate * min_gain
        for shape in shapes:
            rate = self.predict(acc, shape, batch, context, drafter).tokens_per_s
            if rate > max(best_rate, floor):
                best, best_rate = shape, rate
        return best


def spire_multiplier(tau: float, draft_s: float, verify_s: float, target_s: float) -> float:
    """SPIRe's TM = τ ÷ ((k·t_draft + t_verify) ÷ t_target) from measured per-step costs:
    `draft_s` the drafting time of a step (all k draft calls), `verify_s` its verification pass,
    `target_s` a plain decoding step's.

    >>> round(spire_multiplier(2.5, 0.010, 0.050, 0.040), 3)       # 2.5 tokens for 1.5 plain steps
    1.667
    """
    if target_s <= 0 or draft_s + verify_s <= 0:
        raise ValueError("step costs must be positive")
    return tau / ((draft_s + verify_s) / target_s)


def fit_acceptance(history: Iterable[tuple[int, int, int, int]]) -> Acceptance:
    """α, coverage and reach from a drafter's steps, each (budget depth, proposed nodes, proposed
    depth, accepted): maximum-likelihood estimates of the three geometric/Bernoulli parts.

    - coverage: steps that proposed ÷ steps that could (budget depth > 0);
    - α: accepted tokens are successes; a step whose accepted path stopped before its tree's
      depth is one failure (the rule of `scheduler.alpha.observe`);
    - reach: levels past the first are successes; a proposal that stopped before the budget's
      depth is one failure.

    >>> fit_acceptance([(4, 4, 4, 4), (4, 4, 4, 1), (4, 2, 2, 1), (4, 0, 0, 0)])
    Acceptance(alpha=0.75, coverage=0.75, reach=0.875)
    """
    steps = proposed = accepted = rejected = levels = stopped = 0
    for budget_depth, nodes, depth, acc in history:
        if budget_depth <= 0:
            continue
        steps += 1
        if nodes == 0:
            continue
        proposed += 1
        accepted += acc
        rejected += acc < depth
        levels += depth - 1
        stopped += depth < budget_depth
    if steps == 0:
        raise ValueError("no step with a draft budget to fit acceptance from")
    return Acceptance(alpha=accepted / (accepted + rejected) if accepted + rejected else 0.0,
                      coverage=proposed / steps,
                      reach=levels / (levels + stopped) if levels + stopped else 1.0)


def fit_drafter_cost(calls: Iterable[tuple[int, float]]) -> DrafterCost:
    """Fixed and per-node seconds from timed draft calls (nodes proposed, seconds), by least
    squares; a negative slope or intercept (noise) is clamped to zero.

    >>> c = fit_drafter_cost([(0, 1e-4), (4, 3e-4), (8, 5e-4)])
    >>> round(c.fixed_s, 6), round(c.per_node_s, 6)
    (0.0001, 5e-05)
    """
    pts = list(calls)
    if not pts:
        return DrafterCost()
    n = len(pts)
    mx = sum(x for x, _ in pts) / n
    my = sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    slope = max(0.0, sum((x - mx) * (y - my) for x, y in pts) / sxx) if sxx else 0.0
    return DrafterCost(fixed_s=max(0.0, my - slope * mx), per_node_s=slope)


def prediction_row(drafter: str, shape: TreeShape, batch: int, context: float | None,
         p: Prediction) -> dict[str, Any]:
    """One configuration's prediction as a JSON row (`specgate plan` prints and measures these)."""
    return {"drafter": drafter, "shape": shape.name, "batch": batch,
            "context": None if context is None else round(context),
            "predicted_tau": round(p.tau, 3), "predicted_nodes": round(p.nodes, 3),
            "predicted_step_ms": round(1000 * (p.step_s + p.draft_s), 3),
            "predicted_tokens_per_s": round(p.tokens_per_s, 2),
            "predicted_plain_tokens_per_s": round(p.plain_tokens_per_s, 2),
            "predicted_multiplier": round(p.multiplier, 3)}
