"""Clairvoyant shortest remaining processing time: ranks by the true remaining work, which only
the simulator knows (it passes `oracle(stats) -> remaining steps`). The lower bound the others are
measured against; never used in serving."""
from __future__ import annotations

from typing import Callable

from scheduler.policies.ordering import Ordering
from scheduler.request import RequestStats


class SRPT(Ordering):
    name = "srpt"

    def __init__(self, *, oracle: Callable[[RequestStats], float]) -> None:
        self.oracle = oracle

    def key(self, s: RequestStats) -> float:
        return float(self.oracle(s))
