"""Least attained service over multi-level queues: a request's level depends only on the verifier
work it has consumed (levels.py); a higher level is served before lower ones and, within a level,
least attained service first. Since the level grows with attained service, that is least attained
service first overall; the levels are kept so that LAS is exactly LAPS-SD without the perceptible
switch (same levels, same quanta). No length prediction, no acceptance estimate."""
from __future__ import annotations

from scheduler.policies.levels import Levels
from scheduler.policies.ordering import BAND, Ordering
from scheduler.request import RequestStats
from scheduler.state import SchedulerState


class LAS(Ordering):
    name = "las"

    def __init__(self, *, n_levels: int = 6, first_quantum: float = 16.0,
                 growth: float = 4.0) -> None:
        self.levels = Levels(n_levels, first_quantum, growth)

    def refresh(self, state: SchedulerState, s: RequestStats) -> None:
        s.level = self.levels.level_of(s.attained, s.level)

    def key(self, s: RequestStats) -> float:
        return s.level * BAND + s.attained
