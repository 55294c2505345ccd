"""First come, first served: arrival order. With per-step planning, a request that has started
keeps its place ahead of everything that arrived after it, so FCFS never preempts except for
aging, priority classes and tenant fairness."""
from __future__ import annotations

from scheduler.policies.ordering import Ordering
from scheduler.request import RequestStats


class FCFS(Ordering):
    name = "fcfs"

    def key(self, s: RequestStats) -> float:
        return s.arrival_s
