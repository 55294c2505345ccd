"""Aging: no request waits longer than a bound between two of its steps.

A request's *wait* is the time since it was last served (since arrival before its first step), so
its deadline is last served + bound. Requests are promoted earliest deadline first (= longest
wait first), ahead of every other ordering, as soon as keeping the deadline gets tight: the i-th
oldest request (0-based) could start at the earliest ⌊i ÷ batch⌋ steps from now if everyone
before it were promoted, so it is at risk when

    deadline − now < ⌊i ÷ batch⌋ · step + longest step + margin_steps · step

(step = the average step duration; the longest step covers the overshoot of looking only between
steps; when the planner is about to prefill a prompt longer than any step seen so far, it asks
again with that step's estimated duration). When the i-th is at risk, the oldest min(i + 1, batch) are promoted. Looking ahead over a
few batches' worth of the oldest requests keeps the bound when a backlog of old requests comes
due at once, as long as the engine could serve them in time at all.

The index is an ordered dict of request ids, least recently served first: serving a request moves
it to the end, so every operation is O(1) and finding the overdue ones reads only the front.
NOTE: an arrival is appended when it is admitted, which can be up to one step after it arrived, so
the order is exact only to within one step; the margin covers that too.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterable

from scheduler.request import RequestStats
from scheduler.state import SchedulerState


class AgingIndex:
    def __init__(self, bound_s: float | None, margin_steps: float = 2.0) -> None:
        self.bound_s = bound_s
        self.margin_steps = margin_steps
        self._order: OrderedDict[str, None] = OrderedDict()

    def clear(self) -> None:
        self._order.clear()

    def rebuild(self, requests: Iterable[RequestStats]) -> None:
        self._order = OrderedDict((s.request_id, None) for s in
                                  sorted(requests, key=lambda s: s.last_served_s))

    def add(self, stats: RequestStats) -> None:
        if self.bound_s is not None:
            self._order[stats.request_id] = None

    def served(self, request_ids: Iterable[str]) -> None:
        if self.bound_s is not None:
            move = self._order.move_to_end
            for rid in request_ids:
                move(rid)

    def remove(self, request_id: str) -> None:
        self._order.pop(request_id, None)

    def overdue(self, state: SchedulerState, now: float, limit: int,
                longest_step_s: float = 0.0, lookahead_batches: int = 4) -> list[str]:
        """The ids to promote this step (at most `limit`), oldest first. `longest_step_s`: a
        longer step than any seen is coming (the planner knows it is about to prefill)."""
        if self.bound_s is None or not self._order:
            return []
        step = state.step_s or 0.0
        longest = max(state.step_s_max, longest_step_s)
        base = longest + self.margin_steps * step - self.bound_s   # deadline = t + bound
        last = lookahead_batches * limit
        horizon = now + base + lookahead_batches * step      # past this, nobody in view is at risk
        requests, at_risk, oldest = state.requests, 0, []
        for i, rid in enumerate(self._order):
            t = requests[rid].last_served_s
            if t > horizon or i >= last:
                break
            if i < limit:
                oldest.append(rid)
            if t <= now + base + (i // limit) * step:
                at_risk = i + 1
        return oldest[:min(at_risk, limit)]
