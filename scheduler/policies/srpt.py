"""Clairvoyant shortest remaining processing time: ranks by the true remaining work, which only
the simulator knows (it passes `oracle(stats) -> remaining steps`). The lower bound the others are
measured against; never used in serving."""
from __future__ import annotations

from typing import Callable

from scheduler.policies.base import Policy
from scheduler.request import RequestStats


class SRPT(Policy):
    name = "srpt"

    def __init__(self, config=None, *, oracle: Callable[[RequestStats], float],
                 **overrides) -> None:
        self.oracle = oracle
        super().__init__(config, **overrides)

    def key(self, s: RequestStats) -> float:
        return float(self.oracle(s))
