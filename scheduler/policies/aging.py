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

**Total wait** (`total_bound_s`, optional): the bound above is on each gap, so a request can still
be served one step per bound, and under a burst a long request that a size-based order keeps
putting off finishes far later than under FCFS (the tail). With a total bound, a request whose
time spent waiting since arrival (latency so far minus its time in steps) passes it is promoted,
those that have waited longest first: past the bound requests are served by their waiting, as
FCFS would. Its deadline, arrival + time in steps + bound, moves only when it is served, so a
heap holds them.

**Pauses** (scheduler/policies/pauses.py): a request whose stream's reader fell behind is out
of the index while paused, and comes back with the pause added to its last service and to its
total-wait deadline (`RequestStats.paused_s`): time nobody wanted it served is no wait.

**Per tier** (`TierAging`): each service tier (scheduler/tiers.py) has an index of its own, with
its own bound: the tier's maximum wait (`PolicyConfig.tier_wait_s`; the deployment's
`aging_bound_s` for a tier not named there). Ages compare within a tier only, and what an
overdue request goes ahead of is its band (`scheduler.tiers.BANDS`): a flex request is held to
flex's wait, ahead of default's queue, and never ahead of a priority request.
"""
from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Iterable, Mapping

from scheduler.request import RequestStats
from scheduler.state import SchedulerState
from scheduler.tiers import TIERS, tier_of


class AgingIndex:
    def __init__(self, bound_s: float | None, margin_steps: float = 2.0,
                 total_bound_s: float | None = None) -> None:
        self.bound_s = bound_s
        self.margin_steps = margin_steps
        self.total_bound_s = total_bound_s
        self._order: OrderedDict[str, None] = OrderedDict()
        self._totals: list[tuple[float, str]] = []     # (total-wait deadline, id), lazily
        self._deadline: dict[str, float] = {}

    def clear(self) -> None:
        self._order.clear()
        self._totals.clear()
        self._deadline.clear()

    def rebuild(self, requests: Iterable[RequestStats]) -> None:
        requests = list(requests)
        self.clear()
        self._order = OrderedDict((s.request_id, None) for s in
                                  sorted(requests, key=lambda s: s.last_served_s))
        for s in requests:
            self._push_total(s)

    def add(self, stats: RequestStats) -> None:
        if self.bound_s is not None:
            self._order[stats.request_id] = None
        self._push_total(stats)

    def restore(self, s: RequestStats, requests: Mapping[str, RequestStats]) -> None:
        """A request back from a pause (pauses.py), its last service moved on by the pause: in
        its place among the others by that time (`add` appends, as an arrival is the newest), so
        that `overdue`, which reads the front only, still finds the oldest first."""
        if self.bound_s is not None:
            t, order = s.last_served_s, list(self._order)
            at = next((i for i, r in enumerate(order) if requests[r].last_served_s > t), len(order))
            order.insert(at, s.request_id)
            self._order = OrderedDict.fromkeys(order)
        self._push_total(s)

    def served(self, request_ids: Iterable[str], requests: dict | None = None) -> None:
        if self.bound_s is not None:
            move = self._order.move_to_end
            for rid in request_ids:
                move(rid)
        if self.total_bound_s is not None and requests is not None:
            for rid in request_ids:
                self._push_total(requests[rid])

    def remove(self, request_id: str) -> None:
        self._order.pop(request_id, None)
        self._deadline.pop(request_id, None)

    def _push_total(self, s: RequestStats) -> None:
        if self.total_bound_s is not None:
            d = s.arrival_s + s.in_steps_s + s.paused_s + self.total_bound_s
            self._deadline[s.request_id] = d
            heapq.heappush(self._totals, (d, s.request_id))
            if len(self._totals) > 2 * len(self._deadline) + 64:
                self._totals = [(d, r) for r, d in self._deadline.items()]
                heapq.heapify(self._totals)

    def past_total(self, now: float, limit: int, step_s: float = 0.0) -> list[str]:
        """Ids whose total wait passes the total bound by the end of the next step (at most
        `limit`), those past it longest first."""
        if self.total_bound_s is None:
            return []
        heap, live, out, back = self._totals, self._deadline, [], []
        while heap and len(out) < limit:
            d, rid = heap[0]
            if live.get(rid) != d:
                heapq.heappop(heap)                   # stale: served since, or gone
                continue
            if d > now + step_s:
                break
            out.append(rid)
            back.append(heapq.heappop(heap))
        for entry in back:
            heapq.heappush(heap, entry)
        return out

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


class TierAging:
    """One `AgingIndex` per service tier, each with the tier's bound (module docstring)."""

    def __init__(self, bound_s: float | None, margin_steps: float = 2.0,
                 total_bound_s: float | None = None,
                 tier_bounds: Mapping[str, float | None] | None = None) -> None:
        """`tier_bounds`: tier -> its bound (None: none); a tier not named gets `bound_s`."""
        bounds = dict(tier_bounds or {})
        self.indexes = {t: AgingIndex(bounds.get(t, bound_s), margin_steps, total_bound_s)
                        for t in TIERS}
        self.total_bound_s = total_bound_s

    @property
    def bounded(self) -> bool:
        """Whether any tier's gaps are held to a bound (else promotions never depend on the
        length of the coming step)."""
        return any(i.bound_s is not None for i in self.indexes.values())

    def clear(self) -> None:
        for index in self.indexes.values():
            index.clear()

    def rebuild(self, requests: Iterable[RequestStats]) -> None:
        by_tier: dict[str, list[RequestStats]] = {t: [] for t in TIERS}
        for s in requests:
            by_tier[tier_of(s.tier)].append(s)
        for tier, index in self.indexes.items():
            index.rebuild(by_tier[tier])

    def add(self, s: RequestStats) -> None:
        self.indexes[tier_of(s.tier)].add(s)

    def restore(self, s: RequestStats, requests: Mapping[str, RequestStats]) -> None:
        self.indexes[tier_of(s.tier)].restore(s, requests)

    def served(self, request_ids: Iterable[str], requests: dict) -> None:
        by_tier: dict[str, list[str]] = {}
        for rid in request_ids:
            by_tier.setdefault(tier_of(requests[rid].tier), []).append(rid)
        for tier, ids in by_tier.items():
            self.indexes[tier].served(ids, requests)

    def remove(self, request_id: str) -> None:
        for index in self.indexes.values():
            index.remove(request_id)

    def due(self, tiers: Iterable[str], state: SchedulerState, now: float, limit: int,
            longest_step_s: float = 0.0) -> list[str]:
        """The requests of `tiers` to promote this step (at most `limit`), tier by tier in the
        order given: in each, gaps at risk of passing its bound first (`overdue`), then
        requests past the total-wait bound (`past_total`)."""
        out: list[str] = []
        step_s = state.step_s or 0.0
        for tier in tiers:
            index = self.indexes[tier]
            ids = index.overdue(state, now, limit, longest_step_s=longest_step_s)
            if len(ids) < limit and index.total_bound_s is not None:
                seen = set(ids)
                ids += [r for r in index.past_total(now, limit, step_s) if r not in seen]
            out += ids[:limit - len(out)]
            if len(out) >= limit:
                break
        return out
