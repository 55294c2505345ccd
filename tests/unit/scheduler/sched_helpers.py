"""Helpers for scheduler tests: hand-built queues and synthetic steps."""
from __future__ import annotations

from scheduler.request import RequestStats, Status, StepRecord
from scheduler.state import SchedulerState


def stats(rid: str, *, tenant: str = "t", arrival: float = 0.0, predicted: int | None = 100,
          max_tokens: int = 4096, priority: int = 0, attained: int = 0, committed: int = 0,
          taus: tuple[int, ...] = ()) -> RequestStats:
    """A request with an optional history: `taus` are τ per step, each step verifying 4 tokens
    unless `attained` says otherwise."""
    s = RequestStats(rid, tenant, arrival, prompt_len=10, max_tokens=max_tokens,
                     priority=priority, predicted_len=predicted)
    t = arrival
    for tau in taus:
        t += 0.1
        s.record_step(StepRecord(rid, 4, tau, tried=tau), t - 0.1, t)
    if attained:
        s.attained = attained
    if committed:
        s.committed = committed
    s.status = Status.PREEMPTED if taus else Status.QUEUED
    return s


def build(policy, requests: list[RequestStats]) -> SchedulerState:
    state = SchedulerState()
    for s in requests:
        policy.add(state, s)
    return state


def step(policy, state: SchedulerState, now: float, *, tau: int = 2, step_s: float = 0.1,
         finish: set[str] = frozenset()):
    """Plan at `now`, give every chosen request τ = `tau`, update at now + step_s."""
    plan = policy.plan(state, now)
    records = [StepRecord(rid, 1 + b.max_nodes, tau, "stop" if rid in finish else None,
                          b.max_depth) for rid, b in plan.entries]
    policy.update(state, records, now + step_s, step_s)
    return plan
