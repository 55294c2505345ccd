"""What the batch planner plans with (`PolicyConfig`) and what it hands the step loop (`Plan`).

Plain data: the planner (planner.py) and its parts read the config; the step loop, the
simulator and the benches read the plan.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, NamedTuple

from scheduler.sizing import SizingConfig
from scheduler.step_cost import StepCost
from scheduler.tiers import TIERS
from workers.contract import TreeBudget


@dataclass(frozen=True)
class PolicyConfig:
    max_batch: int = 8
    token_budget: int = 64                 # per step: Σ over chosen of (1 + tree nodes)
    aging_bound_s: float | None = 60.0     # None: no aging
    aging_margin_steps: float = 2.0
    total_wait_bound_s: float | None = None   # see aging.py, "Total wait"; None: no such bound
    # each service tier's maximum wait (scheduler/tiers.py): aging holds the tier's requests to it
    # (aging.py, "Per tier"); a tier not named: aging_bound_s; None: no bound (misses only counted)
    tier_wait_s: Mapping[str, float | None] = field(default_factory=dict)
    tenant_weights: Mapping[str, float] = field(default_factory=dict)
    # how far (verified tokens over weight) a tenant may run ahead of the least served before it
    # gets only what nobody else wants: one full step's tree tokens at the default token budget.
    # Four steps' worth let a flood of cheap fresh requests (which rank first) hold another
    # tenant's running stream out of the batch for that long each time it came back
    fair_lag_tokens: float = 64.0
    # what one prefilled context token counts against its tenant's virtual time, in verified
    # tree tokens (fairness.py, "Prefill"); None: what the step cost says a prefilled token costs
    # beside a verified one (`prefill_weight`), 0: prefill is free to the tenant
    fair_prefill_weight: float | None = None
    sizing: SizingConfig = SizingConfig()  # tree sizing: caps and gains (scheduler/sizing.py)
    # New requests start from their (tenant, drafter)'s learned prior (alpha.DrafterPrior); off,
    # every request starts from the fixed one, its sizing independent of what ran before it.
    learn_priors: bool = True
    step_cost: StepCost | None = None      # measured cost model for goodput-aware tree budgets
    step_s_smoothing: float = 0.1          # weight of the newest step in the step-duration average
    max_resident: int | None = None        # requests that may hold KV at once (see `plan`)
    # context tokens a step may prefill for each chosen request still waiting for its context,
    # in chunks beside the trees (`chunk_budget`); 0: the step loop prefills each request whole,
    # in a pass of its own, before its first step
    prefill_chunk_tokens: int = 0
    # in a step shared by several tenants, the least share of the rows beyond one a request that
    # each tenant's chunks and draft nodes may take (its weight's share if larger): what keeps one
    # tenant's drafts and prefills from stretching every other tenant's gaps (row_shares.py);
    # None: no shares, the rows go wherever they commit the most
    tenant_row_share: float | None = 0.5
    # attention over this many keys costs about what one row's linears do: a chunk of k tokens
    # after o tokens of context counts k × (1 + o / this) against prefill_chunk_tokens, so a
    # step with a chunk costs about the same early and late in a long prompt. None: the step
    # cost's measured chunk fit (`StepCost.keys_per_row`), else DEFAULT_KEYS_PER_ROW
    prefill_keys_per_row: float | None = None
    # KV slots every live request together may hold (the worker's KV budget in slots); None: no
    # byte limit. The planner defers starts and preempts by it (`KVBudget`, scheduler/kv_budget.py),
    # with the verifier's block and tree sizes (a request's first allocation and growth). Where
    # the state carries one budget per home (`SchedulerState.kv_budgets`), those apply instead
    kv_budget_tokens: int | None = None
    kv_block: int = 256
    kv_tree_tokens: int = 65

    def check(self) -> None:
        """Raise ValueError for a config no planner can run with."""
        if self.max_batch < 1 or self.token_budget < 1:
            raise ValueError("max_batch and token_budget must be ≥ 1")
        if self.max_resident is not None and self.max_resident < self.max_batch:
            raise ValueError("max_resident must hold at least one full batch")
        if self.prefill_chunk_tokens < 0:
            raise ValueError("prefill_chunk_tokens must be >= 0 (0: whole prefills)")
        if self.tenant_row_share is not None and not 0 < self.tenant_row_share <= 1:
            raise ValueError("tenant_row_share must be in (0, 1] (or None: no shares)")
        if self.prefill_keys_per_row is not None and not self.prefill_keys_per_row > 0:
            raise ValueError("prefill_keys_per_row must be > 0")
        for tier, wait in self.tier_wait_s.items():
            if tier not in TIERS:
                raise ValueError(f"tier_wait_s: unknown tier {tier!r}; known: {', '.join(TIERS)}")
            if wait is not None and not wait > 0:
                raise ValueError(f"tier_wait_s[{tier!r}] must be > 0 (or None: no bound)")


class PlanEntry(NamedTuple):
    request_id: str
    budget: TreeBudget


@dataclass(slots=True)
class Plan:
    """One step's batch: request ids (best first, unless everyone fit) and their tree budgets;
    with chunked prefill, the context tokens each prefills this step, and how many at the end
    only prefill (admitted ahead of their turn: they commit nothing)."""
    request_ids: list[str]
    budgets: list[TreeBudget]
    aged: int = 0                          # how many of them were promoted by aging
    prefill: list[int] = field(default_factory=list)   # per request; empty: no chunks
    warm: int = 0                          # the last `warm` requests only prefill
    evict: list[str] = field(default_factory=list)     # free these requests' KV first (budget)
    # with a KV budget per home: the home each request that starts this step starts on (the
    # planner places, the worker prefills there)
    homes: dict[str, str | None] = field(default_factory=dict)

    @property
    def entries(self) -> list[PlanEntry]:
        return [PlanEntry(r, b) for r, b in zip(self.request_ids, self.budgets)]

    @property
    def tokens(self) -> int:
        """Σ over the batch of (1 root token + tree nodes): at most the token budget."""
        return len(self.request_ids) + sum(b.max_nodes for b in self.budgets)

    def __len__(self) -> int:
        return len(self.request_ids)
