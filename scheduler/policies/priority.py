"""Strict priority: service tiers, then tenants' classes, in strict order (the planner's classes,
scheduler/tiers.py), first come first served inside each, nothing predicted and nothing aged.

The baseline a tiered deployment is measured against: priority bands as a gateway's flow control
keeps them, where a lower band is served only when every higher one is empty. It has no aging
(`ages = False`): a flex request waits as long as anything above it is queued, which is what the
tiers' maximum waits in every other policy are there to prevent."""
from __future__ import annotations

from scheduler.policies.ordering import Ordering
from scheduler.request import RequestStats


class Priority(Ordering):
    name = "priority"
    ages = False

    def key(self, s: RequestStats) -> float:
        return s.arrival_s
