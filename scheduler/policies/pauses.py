"""Paused requests: live requests held out of the plan while their stream's reader catches up.

A streamed request whose client stops reading (the gateway's writer stops pulling its tokens:
gateway/service/stream.py) gains nothing from being generated early, and every step it takes,
and the KV it holds, are taken from other tenants. So the gateway pauses it when its unread
tokens pass a bound, and resumes it when they drain below a lower mark (the step loop applies
both at a step boundary, scheduler/intake.py).

While paused a request is in `SchedulerState.paused`, not `requests`: in no queue and no aging
index, never planned, charged or promoted, and not counted by anything that reads the live
requests (the fast path that takes everyone, the KV budget, the miss forecast); the step loop
evicts its KV as it pauses it, so nothing the planner budgets by is held by a request it cannot
see. It still ends on a cancel (`BatchPlanner.remove`).

Resumed, it goes back with its place: its key is worked out again from its own stats (attained
service, predicted length, arrival), which a pause does not change; the pause is added to its
last service and to `paused_s`, so that aging's gap and total-wait bounds count only the time the
scheduler kept it waiting (aging.py, "Pauses"). Its tenant's virtual time is untouched, except
that a tenant whose only live requests were paused comes back as any tenant that was idle does
(fairness.py: at the class's floor, no banked credit). It is prefilled again (prompt + committed
output) when next planned, like any evicted request.
"""
from __future__ import annotations

from scheduler.policies.aging import TierAging
from scheduler.policies.queues import RequestQueues
from scheduler.request import RequestStats, Status
from scheduler.state import SchedulerState


class Pauses:
    """The planner's paused requests and when each was paused (module docstring). Shares the
    planner's queues, aging and membership sets (the same objects), so that pausing takes a
    request out of everything a plan reads; loop thread only, as the planner."""

    def __init__(self, queues: RequestQueues, aging: TierAging, started: set[str],
                 warming: dict[str, None]) -> None:
        self.queues, self.aging, self.started, self.warming = queues, aging, started, warming
        self.since: dict[str, float] = {}       # request id -> when it was paused

    def __len__(self) -> int:
        return len(self.since)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.since

    def pause(self, state: SchedulerState, request_id: str, now: float) -> RequestStats | None:
        """Take a live request out of the plan; returns it, or None when it is not live or
        already paused. The caller frees its KV (the step loop: `KVResidency.evict`)."""
        s = state.requests.pop(request_id, None)
        if s is None:
            return None
        state.paused[request_id] = s
        self.since[request_id] = now
        state.running.discard(request_id)
        if s.status is Status.RUNNING:
            s.status = Status.PREEMPTED
        self.queues.remove(s)
        self.aging.remove(request_id)
        self.started.discard(request_id)
        self.warming.pop(request_id, None)
        return s

    def resume(self, state: SchedulerState, request_id: str, now: float) -> RequestStats | None:
        """Put a paused request back in the plan with its place; returns it, or None when it is
        not paused (ended meanwhile, or never paused)."""
        s = state.paused.pop(request_id, None)
        if s is None:
            return None
        held = max(now - self.since.pop(request_id), 0.0)
        s.last_served_s += held
        s.paused_s += held
        state.requests[request_id] = s
        self.queues.add(state, s)
        self.aging.restore(s, state.requests)
        return s

    def end(self, state: SchedulerState, request_id: str) -> RequestStats | None:
        """Forget a paused request that is ending (cancelled, failed); returns it, or None."""
        self.since.pop(request_id, None)
        return state.paused.pop(request_id, None)
