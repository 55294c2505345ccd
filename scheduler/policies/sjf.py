"""Shortest job first by predicted output length (the prediction made at arrival; requests with no
prediction go last). It ignores acceptance: a long request with a high α may be quicker to serve
than a short one with a low α, which is the mis-ordering LAPS-SD corrects. Preemptive at step
boundaries: a newly arrived shorter request takes the slot of a longer running one."""
from __future__ import annotations

import math

from scheduler.policies.ordering import Ordering
from scheduler.request import RequestStats


class SJF(Ordering):
    name = "sjf"

    def key(self, s: RequestStats) -> float:
        return math.inf if s.predicted_len is None else float(s.predicted_len)
