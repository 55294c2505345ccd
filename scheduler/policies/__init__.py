"""Scheduling policies behind one interface (`Policy.plan`, `Policy.update`) and a factory."""
from __future__ import annotations

from scheduler.policies.base import BAND, Plan, PlanEntry, Policy, PolicyConfig
from scheduler.policies.fcfs import FCFS
from scheduler.policies.laps import LAPS
from scheduler.policies.las import LAS
from scheduler.policies.sjf import SJF
from scheduler.policies.srpt import SRPT

POLICIES: dict[str, type[Policy]] = {p.name: p for p in (FCFS, SJF, LAS, LAPS, SRPT)}


def make_policy(name: str, config: PolicyConfig | None = None, **cfg) -> Policy:
    """Build a policy by name. `cfg` holds PolicyConfig fields and the policy's own options
    (e.g. `make_policy("laps", max_batch=8, n_levels=6)`; srpt needs `oracle=`)."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}") from None
    return cls(config, **cfg)


__all__ = ["BAND", "POLICIES", "Plan", "PlanEntry", "Policy", "PolicyConfig", "make_policy",
           "FCFS", "SJF", "LAS", "LAPS", "SRPT"]
