"""How many KV slots a request holds or will hold: the one model the planner admits, defers and
preempts by (scheduler/policies/base.py `_fit_kv`), matching how the verifier allocates
(workers/speculation/verifier.py): a request starts with room for its context, one block of output (less if
fewer tokens are wanted) and one tree; when a step's tree would not fit, its KV grows by a block
or by half of what it holds, whichever is more.

Pure functions of a request's stats. Slots, not bytes: the builder turns the byte budget
(`--kv-cache-mb`) into slots once, at the model's bytes per slot (every layer's K and V).

Where KV lives in several places (Ray mode: each verifier replica has its own pool), each place
is a **home** with a budget of its own (`SchedulerState.kv_budgets`); a new request starts on
the home with the largest share of its budget free (`most_room`); the planner places it there
(`Plan.homes`) and Ray mode's router honours that (gateway/ray_serve/routing.py `rank_replicas`).

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

from typing import Mapping

from scheduler.request import RequestStats
from scheduler.state import SchedulerState


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


def kv_homes(state: SchedulerState, budget: int | None) -> dict[str | None, tuple[int, int]] | None:
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
