"""The scheduler state a policy plans over: live requests, the current batch, tenant accounts.

This is the data a state store persists (memory or Redis). A policy's own indexes (heaps) are
derived from it and can be rebuilt from it (`BatchPlanner.rebuild`), e.g. after a restart.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.request import RequestStats


@dataclass(slots=True)
class SchedulerState:
    requests: dict[str, RequestStats] = field(default_factory=dict)   # live requests only
    running: set[str] = field(default_factory=set)       # ids in the latest step's batch
    # Live requests held out of the plan while their stream's reader catches up
    # (scheduler/policies/pauses.py): in no queue, holding no KV, not in `requests`.
    paused: dict[str, RequestStats] = field(default_factory=dict)
    # Tenant fairness, per (priority class, tenant): virtual time = verified tree tokens ÷ weight.
    virtual_time: dict[tuple[int, str], float] = field(default_factory=dict)
    step_s: float | None = None                          # moving average of a step's duration
    step_s_max: float = 0.0                              # longest step seen
    kv_tokens: int = 0                                   # KV slots held by every live request
    # Several KV budgets (Ray mode: one per verifier replica, as the step loop last refreshed
    # them): home -> its budget in slots, and home -> slots its live requests hold. Empty: one
    # budget, the policy's own (`PolicyConfig.kv_budget_tokens`), over `kv_tokens`.
    kv_budgets: dict[str, int] = field(default_factory=dict)
    kv_held: dict[str, int] = field(default_factory=dict)
