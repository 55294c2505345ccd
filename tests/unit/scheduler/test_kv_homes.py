"""KV budgets per home (Ray mode: one per verifier replica): a start is planned only where some
home has room for it, on the home with the largest share free; a resident's growth is checked against its
own home's budget, and KV is freed on that home only; over a random run with a worker of two
homes, no home holds more than its budget."""
from __future__ import annotations

import doctest
import random
from collections import Counter
from dataclasses import replace

import pytest

from scheduler.loop import Delta, StepLoop
from scheduler import kv_budget
from scheduler.kv_budget import placement_key
from scheduler.policies import make_policy
from scheduler.request import Request, RequestStats
from scheduler.state import SchedulerState
from workers.fake_worker import FakeClock, FakeWorker, token_at

BLOCK, TREE = 16, 16


def request(rid: str, prompt_len: int, max_tokens: int) -> Request:
    stats = RequestStats(rid, "t", 0.0, prompt_len=prompt_len, max_tokens=max_tokens)
    return Request(stats, prompt_ids=list(range(3, 3 + prompt_len)))


class Tokens(dict):
    def __call__(self, event):
        if isinstance(event, Delta):
            self.setdefault(event.request_id, []).extend(event.token_ids)


def policy(max_batch: int, name: str = "sjf", **kw):
    return make_policy(name, max_batch=max_batch, token_budget=64, aging_bound_s=None,
                       kv_block=BLOCK, kv_tree_tokens=TREE, **kw)


def state_with(budgets: dict[str, int], pol, rows) -> SchedulerState:
    """rows: (id, predicted length, prompt, committed, kv held, home, steps)."""
    state = SchedulerState(kv_budgets=dict(budgets))
    for rid, predicted, prompt, committed, kv, home, steps in rows:
        s = RequestStats(rid, "t", 0.0, prompt_len=prompt, max_tokens=500, predicted_len=predicted)
        s.committed, s.kv_tokens, s.kv_home, s.n_steps = committed, kv, home if kv else None, steps
        pol.add(state, s)
        if kv:
            state.kv_tokens += kv
            state.kv_held[home] = state.kv_held.get(home, 0) + kv
    return state


def test_kv_budget_doctests():
    assert doctest.testmod(kv_budget).failed == 0


def test_a_start_is_planned_only_where_one_home_has_room_for_it():
    """A start of 60 + 16 + 16 = 92 slots: 50 free on each home is 100 in all, but fits neither."""
    pol = policy(max_batch=3)
    rows = [("new", 1, 60, 0, 0, None, 0),
            ("ra", 50, 50, 0, 250, "a", 1), ("rb", 60, 50, 0, 150, "b", 1)]
    state = state_with({"a": 300, "b": 200}, pol, rows)
    plan = pol.plan(state, 1.0)
    assert plan.request_ids == ["ra", "rb"] and plan.evict == []
    assert not pol.kv_fits(state, state.requests["new"])
    # with one budget of the same 500 slots, 100 free: it would start
    one = policy(max_batch=3, kv_budget_tokens=500)
    flat = state_with({}, one, rows)
    assert one.plan(flat, 1.0).request_ids == ["new", "ra", "rb"]
    # b frees 50 slots: now b has room, and the start is planned there
    state.requests["rb"].kv_tokens = 100
    state.kv_held["b"] = 100
    plan = pol.plan(state, 2.0)
    assert plan.request_ids == ["new", "ra", "rb"] and plan.evict == []
    assert plan.homes == {"new": "b"} and pol.kv_fits(state, state.requests["new"])


def test_two_starts_take_the_home_with_most_room_in_turn():
    pol = policy(max_batch=3)
    rows = [(f"n{i}", i + 1, 60, 0, 0, None, 0) for i in range(3)]
    state = state_with({"a": 170, "b": 150}, pol, rows)
    plan = pol.plan(state, 1.0)
    # 92 slots each: n0 -> a (170 free), n1 -> b (150 > 78 left on a), n2 fits neither (78, 58)
    assert plan.request_ids == ["n0", "n1"]
    assert plan.homes == {"n0": "a", "n1": "b"}


def test_growth_on_a_full_home_evicts_a_request_homed_there_not_on_the_other():
    """`top` (home a) outgrows its slots; a holds `idle_a` too, b holds `idle_b`, ranked worse.
    Only a's budget is short, so a's idle request gives its KV up, though b's is the worse ranked."""
    pol = policy(max_batch=1)
    rows = [("top", 5, 50, 60, 100, "a", 3),          # 110 + its tree > 100: grows by a block (50)
            ("idle_a", 50, 50, 0, 160, "a", 3),
            ("idle_b", 90, 50, 0, 250, "b", 3)]
    state = state_with({"a": 300, "b": 300}, pol, rows)
    plan = pol.plan(state, 1.0)
    assert plan.request_ids == ["top"] and plan.evict == ["idle_a"]
    # one budget of 600 slots would have room for the growth: nobody is freed
    one = policy(max_batch=1, kv_budget_tokens=600)
    assert one.plan(state_with({}, one, rows), 1.0).evict == []


def test_the_chosen_wait_only_on_the_home_that_is_short():
    """With nobody left out to free on b, b's last chosen request waits (is preempted); a's
    requests run, though a's is last in the plan; the first chosen on each home always runs."""
    pol = policy(max_batch=3)
    rows = [("b1", 1, 50, 60, 100, "b", 3), ("b2", 2, 50, 60, 100, "b", 3),
            ("a1", 3, 50, 60, 100, "a", 3)]
    state = state_with({"a": 300, "b": 250}, pol, rows)   # b: 200 + 2 × 50 growth > 250
    plan = pol.plan(state, 1.0)
    assert plan.request_ids == ["b1", "a1"] and plan.evict == ["b2"]


def test_a_request_homed_on_a_replica_without_a_budget_is_not_fitted():
    """A home that no longer reports (its replica died): its requests are not counted anywhere,
    and their growth is not held back (the pool moves them when it finds them gone)."""
    pol = policy(max_batch=2)
    rows = [("lost", 1, 50, 60, 100, "gone", 3), ("ra", 2, 50, 0, 250, "a", 3)]
    state = state_with({"a": 300}, pol, rows)
    plan = pol.plan(state, 1.0)
    assert plan.request_ids == ["lost", "ra"] and plan.evict == []


class TwoHomes:
    """Two fake workers as two verifier replicas with a KV budget each: a prefill goes to the one
    with the largest share of its budget free (then the fewest requests), as Ray mode's router places it; every
    answer names the home, and `kv_budgets` reports (budget, held) per home like `VerifierPool`."""

    def __init__(self, budgets: dict[str, int], clock: FakeClock, seed: int = 0):
        self.budgets = budgets
        self.homes = {h: FakeWorker(alpha=0.6, clock=clock, kv_block=BLOCK, seed=seed + i)
                      for i, h in enumerate(budgets)}
        self.context_limit = 4096
        self.where: dict[str, str] = {}
        self.placed = 0                         # prefills the planner placed (`Plan.homes`)

    def kv_budgets(self) -> dict[str, tuple[int, int]]:
        return {h: (self.budgets[h], w.kv_tokens()) for h, w in self.homes.items()}

    def prefill(self, request_id, token_ids, home=None, **kw):
        if home is None:                        # not placed by the planner: as the router ranks
            free = {h: (b - held) / b for h, (b, held) in self.kv_budgets().items()}
            loads = Counter(self.where.values())
            home = min(free, key=lambda h: placement_key(h, free[h], loads[h]))
        else:
            self.placed += 1
        done = self.homes[home].prefill(request_id, token_ids, **kw)
        self.where[request_id] = home
        return replace(done, home=home)

    def step(self, items):
        by_id = {}
        for home, w in self.homes.items():
            mine = [i for i in items if self.where[i.request_id] == home]
            if mine:
                by_id.update((r.request_id, replace(r, home=home)) for r in w.step(mine))
        return [by_id[i.request_id] for i in items]

    def release(self, request_id):
        home = self.where.pop(request_id, None)
        if home is not None:
            self.homes[home].release(request_id)

    evict = release

    def resident(self):
        return list(self.where)


@pytest.mark.parametrize("name, chunk, seed", [("fcfs", 0, 1), ("las", 0, 2), ("sjf", 24, 3),
                                               ("laps", 24, 4)])
def test_no_home_holds_more_than_its_budget_over_a_random_run(name, chunk, seed):
    rng = random.Random(seed)
    clock = FakeClock()
    budgets = {"a": 400, "b": 250}
    worker = TwoHomes(budgets, clock, seed)
    pol = make_policy(name, max_batch=4, token_budget=64, aging_bound_s=None, kv_block=BLOCK,
                      kv_tree_tokens=TREE, prefill_chunk_tokens=chunk)
    loop = StepLoop(pol, worker, max_resident=64, clock=clock, kv_budgets=worker.kv_budgets)
    sink, wanted, n = Tokens(), {}, 0
    homes_used: set[str] = set()
    for step in range(3000):
        if n < 30 and rng.random() < 0.3:
            rid, max_tokens = f"r{n}", rng.randint(5, 120)
            loop.submit(request(rid, rng.randint(5, 90), max_tokens), sink)
            wanted[rid], n = max_tokens, n + 1
        if not loop.step() and n >= 30 and not loop.state.requests:
            break
        held = {h: w.kv_tokens() for h, w in worker.homes.items()}
        assert {h: v for h, v in held.items() if v} == loop.state.kv_held      # the loop's count
        for h, w in worker.homes.items():
            if len(w.resident()) > 1:
                assert held[h] <= budgets[h], (step, h, held)
            if w.resident():
                homes_used.add(h)
    assert n == 30 and not loop.state.requests
    assert homes_used == {"a", "b"} and worker.placed >= 30           # the planner placed them
    for rid, max_tokens in wanted.items():
        assert sink[rid] == [token_at(rid, p) for p in range(max_tokens)]
    assert loop.state.kv_tokens == 0 and loop.state.kv_held == {}


def kv_request(rid: str, prompt_len: int, kv: int = 0, home: str | None = None) -> RequestStats:
    s = RequestStats(rid, "t", 0.0, prompt_len=prompt_len, max_tokens=500)
    s.kv_tokens, s.kv_home = kv, home if kv else None
    return s


def test_one_plans_kv_budget_allocates_starts_home_by_home_and_keeps_nothing_after():
    """`KVBudget.allocate`: a start of 60 + 16 + 16 = 92 slots goes to the home with the largest
    share free (b: all of 150, a: 180 of 200), takes it there (b: 58 left), so the next goes to
    a; a third fits neither unless forced (aging). A new budget over the same state starts from
    what the state holds: nothing of the last plan is kept."""
    state = SchedulerState(kv_budgets={"a": 200, "b": 150}, kv_held={"a": 20})
    starts = [kv_request(f"n{i}", 60) for i in range(4)]
    kv = kv_budget.KVBudget(state, None, block=BLOCK, tree=TREE)
    assert [kv.allocate(s) for s in starts[:3]] == [True, True, False]
    assert kv.planned_homes(["n0", "n1", "n2"]) == {"n0": "b", "n1": "a"}
    assert kv.rooms == {"a": 180 - 92, "b": 150 - 92}
    assert kv.allocate(starts[3], force=True) and kv.rooms["a"] < 0      # aging: past the budget
    assert kv.allocate(kv_request("held", 60, kv=100, home="b"))         # holds KV: nothing taken
    again = kv_budget.KVBudget(state, None, block=BLOCK, tree=TREE)
    assert again.rooms == {"a": 180, "b": 150} and again.planned_homes(["n0"]) == {}
    assert again.place(starts[0]) == (True, "b") and again.rooms == {"a": 180, "b": 150}


def test_without_a_budget_every_start_fits_and_nothing_is_freed():
    kv = kv_budget.KVBudget(SchedulerState(kv_tokens=10**6), None, block=BLOCK, tree=TREE)
    assert not kv.limited and kv.allocate(kv_request("n", 10**5))
    assert kv.place(kv_request("m", 10**5)) == (True, None) and kv.planned_homes(["n"]) == {}


def test_fit_frees_the_worst_ranked_resident_left_out_on_the_home_that_is_short():
    """Growth on a: `top` holds 100 slots and grows by half of them; a's budget is 300, held
    290. Of the two left out on a, the worse ranked (`rank`: higher is worse) gives its KV up;
    b's, ranked worse still, keeps it."""
    state = SchedulerState(kv_budgets={"a": 300, "b": 300}, kv_held={"a": 290, "b": 50})
    rows = [kv_request("top", 50, 100, "a"), kv_request("x", 50, 90, "a"),
            kv_request("y", 50, 100, "a"), kv_request("z", 50, 50, "b")]
    for s in rows:
        s.n_steps, state.requests[s.request_id] = 3, s
    rows[0].committed = 60                     # 110 + its tree > 100: grows by 50
    rank = {"top": 1.0, "x": 5.0, "y": 9.0, "z": 99.0}.__getitem__
    kv = kv_budget.KVBudget(state, None, block=BLOCK, tree=TREE)
    assert kv.fit(["top"], rank) == (["top"], ["y"])
