"""Weighted fair sharing of verifier work between the tenants of one priority class.

Each (class, tenant) has a virtual time: the tree tokens verified for it (rejected drafts
included) divided by its weight. A tenant is *eligible* for a step while its virtual time is at
most `lag_tokens` ahead of the least-served active tenant of its class; eligible tenants' requests
compete by the policy's order, and tenants that ran ahead get only the slots nobody eligible
wants (work conserving). A tenant that becomes active after idling starts at the class's floor
(the least virtual time among active tenants), so idle time cannot be banked as credit; into a
class where nobody is active, at the highest virtual time of the class, so that nobody is held
back for what it was served while nobody else asked.

Prefill: a request's context is verifier work too, and a tenant of many short requests is
mostly prompt. Were prefill free to its tenant, such a tenant would win every slot by key (fresh
requests rank first under LAS and LAPS) while its virtual time barely moved. Each prefilled
context token is charged `prefill_weight` verified tokens: what the step cost says one costs
beside a verified tree token of a full step, about half on the default model (prefill runs many
rows through one pass; a verified token shares a step's fixed cost with few others).

`lag_tokens` trades fairness for policy order: 0 is strict weighted round robin between tenants,
∞ is no fairness. A few steps' worth of tokens keeps the policy's order when tenants are balanced
and still stops a flooding tenant after it has run `lag_tokens` ahead.
"""
from __future__ import annotations

from typing import Iterable, Mapping

from scheduler.state import SchedulerState
from scheduler.step_cost import StepCost

DEFAULT_PREFILL_WEIGHT = 0.5    # without a step cost: the default model's order on CPU
REFERENCE_PROMPT = 256          # context tokens the prefill rate is read at


class TenantFairness:
    def __init__(self, weights: Mapping[str, float] | None = None, lag_tokens: float = 64.0,
                 default_weight: float = 1.0) -> None:
        self.weights = dict(weights or {})
        if any(w <= 0 for w in self.weights.values()) or default_weight <= 0:
            raise ValueError("tenant weights must be > 0")
        self.default_weight = default_weight
        self.lag_tokens = lag_tokens

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, self.default_weight)

    def activate(self, state: SchedulerState, cls: int, tenant: str,
                 active: Mapping[str, int]) -> None:
        """`tenant` got its first live request in class `cls`; `active` = the class's tenants."""
        vt = state.virtual_time
        others = [vt.get((cls, t), 0.0) for t in active if t != tenant]
        if others:
            floor = min(others)
        else:   # nobody active: the class's highest, so that a tenant served alone meanwhile
            # (using what nobody else wanted) is not held back until this one catches up
            floor = max((v for (c, _), v in vt.items() if c == cls), default=0.0)
        vt[(cls, tenant)] = max(vt.get((cls, tenant), 0.0), floor)

    def charge(self, state: SchedulerState, cls: int, tenant: str, tokens: float) -> None:
        key = (cls, tenant)
        state.virtual_time[key] = state.virtual_time.get(key, 0.0) + tokens / self.weight(tenant)

    def charge_prefill(self, state: SchedulerState, weight: float,
                       chunks: Iterable[tuple[str, int]]) -> None:
        """Charge the context tokens a plan prefills, (request id, tokens), to their tenants'
        virtual time, as verified ones are charged (module docstring, "Prefill"): by the plan
        that runs them, since a step's records carry verified tokens only. `weight`: verified
        tokens one prefilled token is worth."""
        if not weight:
            return
        requests = state.requests
        for rid, k in chunks:
            if k:
                s = requests[rid]
                self.charge(state, s.plan_class, s.tenant, k * weight)

    def split(self, state: SchedulerState, cls: int,
              tenants: Mapping[str, int]) -> tuple[dict[str, float], float]:
        """Virtual times of the active tenants (a copy the planner may advance) and the limit
        above which a tenant is not eligible."""
        vt = state.virtual_time
        local = {t: vt.get((cls, t), 0.0) for t in tenants}
        return local, min(local.values()) + self.lag_tokens


def prefill_weight(cost: StepCost | None, max_batch: int, token_budget: int) -> float:
    """Verified tree tokens one prefilled context token is worth: seconds a token of a
    REFERENCE_PROMPT-token prefill takes ÷ seconds a tree token of a full step takes.

    >>> from scheduler.step_cost import LinearStepCost
    >>> prefill_weight(LinearStepCost(fixed_s=0.04, per_token_s=0.001), 8, 64)
    0.712
    """
    if cost is None:
        return DEFAULT_PREFILL_WEIGHT
    per_prefilled = cost.prefill(REFERENCE_PROMPT) / REFERENCE_PROMPT
    per_verified = cost(max_batch, token_budget) / token_budget
    return round(per_prefilled / per_verified, 3) if per_verified > 0 else DEFAULT_PREFILL_WEIGHT
