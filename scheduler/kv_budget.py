"""The KV budget: how many KV slots a request holds or will hold, and where a plan's starts go.
The one model the planner admits, defers and preempts by (`KVBudget`), matching how the verifier
allocates (workers/speculation/verifier.py): a request starts with room for its context, one
block of output (less if fewer tokens are wanted) and one tree; when a step's tree would not fit,
its KV grows by a block or by half of what it holds, whichever is more.

The arithmetic is pure functions of a request's stats (`start_slots`, `growth_slots`, ...).
Slots, not bytes: the builder turns the byte budget (`--kv-cache-mb`) into slots once, at the
model's bytes per slot (every layer's K and V).

Where KV lives in several places (Ray mode: each verifier replica has its own pool), each place
is a **home** with a budget of its own (`SchedulerState.kv_budgets`); a new request starts on
the home with the largest share of its budget free (`most_room`); the planner places it there
(`Plan.homes`) and Ray mode's router honours that (gateway/ray_serve/routing.py `rank_replicas`).

`KVBudget` is one plan's placement over those budgets: the room left as the plan takes starts
(`allocate`), the home each start takes, and the requests to free so that the step's growth
fits (`fit`). The planner makes one per `plan()` call (and per `kv_place` question): what is
held comes from the state each time, and nothing of one plan outlives it.

>>> from scheduler.request import RequestStats
>>> s = RequestStats("r", "t", 0.0, prompt_len=1000, max_tokens=8192)
>>> s.kv_tokens = start_slots(s, block=256, tree=65)
>>> s.kv_tokens, growth_slots(s, block=256, tree=65)
(1321, 0)
>>> s.committed = 260                  # 1,260 tokens of context and a tree no longer fit
>>> growth_slots(s, block=256, tree=65)
660
"""
from __future__ import annotations

import heapq
from contextlib import contextmanager
from typing import Callable, Iterator, Mapping

from scheduler.request import RequestStats
from scheduler.state import SchedulerState

Homes = dict[str | None, tuple[int, int]]   # home -> (budget, slots held); None: the one budget


def start_slots(s: RequestStats, *, block: int, tree: int) -> int:
    """Slots a request not holding KV takes when it starts: its context (prompt + committed),
    one block of output or what it still wants if less, and one tree (root included)."""
    wanted = max(s.max_tokens - s.committed, 1)
    return s.prompt_len + s.committed + min(wanted, block) + tree


def growth_slots(s: RequestStats, *, block: int, tree: int) -> int:
    """Slots a resident request may add in its next step: none while its context and a tree
    fit what it holds, else a block or half of what it holds, whichever is more."""
    if s.prompt_len + s.committed + tree <= s.kv_tokens:
        return 0
    return max(block, s.kv_tokens // 2)


def kv_homes(state: SchedulerState, budget: int | None) -> Homes | None:
    """Each KV budget as (budget, slots held), by home: one per home where the state carries
    them (Ray mode: verifier replicas), else the one budget under home None; None: no budget.

    >>> kv_homes(SchedulerState(kv_tokens=70), 100)
    {None: (100, 70)}
    >>> kv_homes(SchedulerState(kv_budgets={"a": 100, "b": 80}, kv_held={"a": 90}), 100)
    {'a': (100, 90), 'b': (80, 0)}
    """
    if state.kv_budgets:
        held = state.kv_held
        return {home: (b, held.get(home, 0)) for home, b in state.kv_budgets.items()}
    return None if budget is None else {None: (budget, state.kv_tokens)}


def kv_rooms(homes: Mapping[str | None, tuple[int, int]] | None) -> dict[str | None, int] | None:
    """Slots left under each budget.

    >>> kv_rooms({"a": (100, 90), "b": (80, 0)})
    {'a': 10, 'b': 80}
    """
    return None if homes is None else {home: b - held for home, (b, held) in homes.items()}


ROOM_STEPS = 8   # free shares that differ by less than 1/8 of a pool count as equal room


def placement_key(home: str | None, free_share: float, load: int) -> tuple:
    """Where a new request goes, lowest first: the home with the larger share of its KV pool
    free, shares counted in eighths (a share, not slots: replicas that loaded one after another
    on one machine get unequal default pools, and by slots the first would take everything;
    eighths, so that while room is plentiful the requests spread by count, which spreads the
    compute), then the fewest requests, then the name. The planner's rule (`most_room`) and
    the router's (gateway/ray_serve/routing.py `rank_replicas`).

    >>> sorted(["a", "b"], key=lambda h: placement_key(h, {"a": 0.99, "b": 0.97}[h], {"a": 3, "b": 1}[h]))
    ['b', 'a']
    >>> sorted(["a", "b"], key=lambda h: placement_key(h, {"a": 0.9, "b": 0.5}[h], {"a": 3, "b": 1}[h]))
    ['a', 'b']
    """
    return (-int(max(free_share, 0.0) * ROOM_STEPS), load, "" if home is None else home)


def most_room(rooms: Mapping, budgets: Mapping, loads: Mapping | None = None) -> str | None:
    """The home a start goes to (`placement_key`), from each home's room and budget in slots
    and the requests it holds.

    >>> most_room({"b": 50, "a": 50, "c": 10}, {"a": 100, "b": 100, "c": 100}), most_room({None: 5}, {None: 9})
    ('a', None)
    >>> most_room({"a": 900, "b": 450}, {"a": 1000, "b": 500}, {"a": 2}), most_room({"a": 600, "b": 450}, {"a": 1000, "b": 500})
    ('b', 'b')
    """
    if len(rooms) == 1:
        return next(iter(rooms))
    loads = loads or {}
    return min(rooms, key=lambda h: placement_key(h, rooms[h] / max(budgets[h], 1), loads.get(h, 0)))


def home_loads(state: SchedulerState) -> dict[str | None, int]:
    """Requests holding KV, by home (what the router's `loads` count)."""
    loads: dict[str | None, int] = {}
    for s in state.requests.values():
        if s.kv_tokens:
            loads[s.kv_home] = loads.get(s.kv_home, 0) + 1
    return loads


class KVBudget:
    """One plan's KV placement (module docstring). Without a budget (`limited` False) every
    start fits and nothing is freed."""

    def __init__(self, state: SchedulerState, budget: int | None, *, block: int, tree: int) -> None:
        self.state = state
        self.homes = kv_homes(state, budget)
        self.rooms = kv_rooms(self.homes)      # slots starts may still take, by home
        self.size = {"block": block, "tree": tree}
        self.at: dict[str, str | None] = {}    # the home each planned start takes
        self._loads: dict[str | None, int] | None = None   # once a start needs them
        self._budget_of = None if self.homes is None else self._budgets()
        # Homes by `placement_key`, lowest first, for the starts of this plan: a plan with many
        # homes places a start per chosen request, and `most_room`'s scan of every home per start
        # made a plan's cost grow with homes × starts. An entry whose key is no longer its
        # home's is stale and dropped at the top; the home a start takes is pushed again with
        # its new key (no other home's key moves). Built at the first start; dropped when
        # `rooms` is replaced (`reopen`, `rooms_kept`).
        self._order: list[tuple[tuple, str | None]] | None = None

    @property
    def limited(self) -> bool:
        return self.homes is not None

    def allocate(self, s: RequestStats, *, force: bool = False) -> bool:
        """Whether `s` holds KV or its start fits the room (then taken from it, on the home
        `most_room` picks, which `home_of` names from then on). With nothing held and nothing
        taken yet, any start fits: a request larger than the budget still runs, alone. `force`
        (aging's promotions): it starts, taking the room even past the budget (`fit` then frees
        residents' KV for it), so a large request cannot be passed over past the aging bound by
        smaller ones that fit."""
        rooms = self.rooms
        if rooms is None or s.kv_tokens:
            return True
        need = start_slots(s, **self.size)
        if self._loads is None:
            self._loads = home_loads(self.state)
        home = self._most_room()
        room = rooms[home]
        if need > room and room < self.homes[home][0] and not force:
            return False
        rooms[home] = room - need
        self.at[s.request_id] = home
        self._loads[home] = self._loads.get(home, 0) + 1
        if self._order is not None:
            heapq.heappush(self._order, (self._key(home), home))
        return True

    def _key(self, home: str | None) -> tuple:
        budget = self._budget_of[home]
        return placement_key(home, self.rooms[home] / max(budget, 1), self._loads.get(home, 0))

    def _most_room(self) -> str | None:
        """`most_room` over this plan's rooms and loads, from the heap of homes."""
        rooms = self.rooms
        if len(rooms) == 1:
            return next(iter(rooms))
        order = self._order
        if order is None:
            order = self._order = [(self._key(h), h) for h in rooms]
            heapq.heapify(order)
        while True:
            key, home = order[0]
            if key == self._key(home):
                return home
            heapq.heappop(order)

    def place(self, s: RequestStats) -> tuple[bool, str | None]:
        """Whether starting `s` now keeps the KV held within the budget (always, without one),
        and the home it would start on (None: the one budget's); takes nothing."""
        if self.homes is None:
            return True, None
        need = start_slots(s, **self.size)
        home = most_room(self.rooms, self._budgets(), home_loads(self.state))
        return self.rooms[home] >= need, home

    def reopen(self) -> None:
        """Every budget's room as the state holds it, before this plan took any."""
        self.rooms = kv_rooms(self.homes)
        self._order = None

    @contextmanager
    def rooms_kept(self) -> Iterator[None]:
        """Allocations inside place their starts (homes, loads) but give the room back after."""
        kept = None if self.rooms is None else dict(self.rooms)
        try:
            yield
        finally:
            self.rooms = kept
            self._order = None

    def home_of(self, s: RequestStats) -> str | None:
        """Where `s`'s KV is (a resident) or is planned to start (`allocate`); None: the one
        budget's home."""
        if not self.state.kv_budgets:
            return None
        return s.kv_home if s.kv_tokens else self.at.get(s.request_id)

    def planned_homes(self, request_ids: list[str]) -> dict[str, str | None]:
        """The home of each of `request_ids` that starts this step, with a budget per home."""
        if not self.state.kv_budgets:
            return {}
        return {r: self.at[r] for r in request_ids if r in self.at}

    def fit(self, chosen: list[str], rank: Callable[[str], float]) -> tuple[list[str], list[str]]:
        """The chosen requests whose KV fits the budget this step, and the requests whose KV to
        free for them. Starts were only chosen where they fit (`allocate`); what may still
        overflow is residents' growth. Then requests left out of the step give their KV up first
        (never served before served, then the worst ranked by `rank`, higher worse), then the
        chosen from the end of the plan wait (a resident one is preempted). The first chosen
        always runs. With a budget per home, each home is fitted on its own: its growth and
        starts against its budget, freeing only requests homed there, the first chosen there
        always running."""
        requests, homes, at = self.state.requests, self.homes, self.home_of
        total = {home: held for home, (_, held) in homes.items()}
        for r in chosen:
            home = at(requests[r])
            if home in total:
                total[home] += self._adds(requests[r])
        over = {home for home, t in total.items() if t > homes[home][0]}
        if not over:
            return chosen, []
        evict = self._free_left_out(set(chosen), over, total, rank)
        keep, first = [], {}
        for r in chosen:                        # the first chosen on each home always runs
            first.setdefault(at(requests[r]), r)
        for r in reversed(chosen):
            s = requests[r]
            home = at(s)
            if home in over and total[home] > homes[home][0] and first[home] != r:
                total[home] -= self._adds(s) + s.kv_tokens
                if s.kv_tokens:
                    evict.append(r)
            else:
                keep.append(r)
        keep.reverse()
        return keep, evict

    def _free_left_out(self, kept: set[str], over: set[str | None], total: dict[str | None, int],
                       rank: Callable[[str], float]) -> list[str]:
        """Residents left out of the step whose KV to free on the homes `over` budget, lowering
        `total`: untouched arrivals first (only their first allocation is lost), then prompts
        partly prefilled, then requests served before; within each, the planning class served
        last first (flex before default before priority, then by tenant class:
        scheduler/tiers.py), then the worst ranked."""
        homes, at = self.homes, self.home_of
        others = sorted((s for s in self.state.requests.values()
                         if s.kv_tokens and s.request_id not in kept and at(s) in over),
                        key=lambda s: (s.n_steps > 0, s.prefill_left != s.unprefilled_context,
                                       -s.plan_class, -rank(s.request_id)))
        evict = []
        for s in others:
            home = at(s)
            if total[home] <= homes[home][0]:
                continue
            evict.append(s.request_id)
            total[home] -= s.kv_tokens
        return evict

    def _adds(self, s: RequestStats) -> int:
        """Slots `s` may add this step: its growth if it holds KV, else its start."""
        return growth_slots(s, **self.size) if s.kv_tokens else start_slots(s, **self.size)

    def _budgets(self) -> dict[str | None, int]:
        return {h: budget for h, (budget, _) in self.homes.items()}
