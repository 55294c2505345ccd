"""Scheduling policies: an order of service each (`Ordering`: fcfs, sjf, las, laps, srpt, and
priority, the strict baseline for service tiers), planned by one batch planner
(`BatchPlanner.plan`, `BatchPlanner.update`), built by name (`make_policy`).

`Policy` is the planner as the step loop, the simulator and the benches hold it.
"""
from __future__ import annotations

from dataclasses import fields, replace

from scheduler.policies.fcfs import FCFS
from scheduler.policies.laps import LAPS
from scheduler.policies.las import LAS
from scheduler.policies.ordering import BAND, Ordering
from scheduler.policies.plan import Plan, PlanEntry, PolicyConfig
from scheduler.policies.planner import BatchPlanner
from scheduler.policies.priority import Priority
from scheduler.policies.sjf import SJF
from scheduler.policies.srpt import SRPT

Policy = BatchPlanner
POLICIES: dict[str, type[Ordering]] = {p.name: p for p in (FCFS, SJF, LAS, LAPS, SRPT, Priority)}
_CONFIG_FIELDS = frozenset(f.name for f in fields(PolicyConfig))


def make_policy(name: str, config: PolicyConfig | None = None, **cfg) -> BatchPlanner:
    """Build a policy by name. `cfg` holds PolicyConfig fields and the policy's own options
    (e.g. `make_policy("laps", max_batch=8, n_levels=6)`; srpt needs `oracle=`)."""
    try:
        ordering = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}") from None
    overrides = {k: v for k, v in cfg.items() if k in _CONFIG_FIELDS}
    options = {k: v for k, v in cfg.items() if k not in _CONFIG_FIELDS}
    config = config or PolicyConfig()
    if overrides:
        config = replace(config, **overrides)
    return BatchPlanner(ordering.build(config, **options), config)


__all__ = ["BAND", "POLICIES", "BatchPlanner", "Ordering", "Plan", "PlanEntry", "Policy",
           "PolicyConfig", "make_policy", "FCFS", "SJF", "LAS", "LAPS", "SRPT", "Priority"]
