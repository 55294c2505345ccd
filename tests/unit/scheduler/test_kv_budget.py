"""KV admitted by slots: the planner starts a request only when its KV fits the budget, preempts
when residents outgrow it, and the loop's count of slots held matches the worker's through
finishes, cancels, preemptions and failures."""
from __future__ import annotations

import pytest

from scheduler.loop import Delta, StepLoop
from scheduler.policies import make_policy
from scheduler.request import Request, RequestStats
from scheduler.state import SchedulerState
from workers.fake_worker import FakeClock, FakeWorker, token_at

BLOCK, TREE = 16, 16


def request(rid: str, prompt_len: int, max_tokens: int, predicted: int | None = None) -> Request:
    stats = RequestStats(rid, "t", 0.0, prompt_len=prompt_len, max_tokens=max_tokens,
                         predicted_len=predicted)
    return Request(stats, prompt_ids=list(range(3, 3 + prompt_len)))


def make(budget: int, *, policy="fcfs", max_batch=4, chunk=0, fail_on=None):
    clock = FakeClock()
    worker = FakeWorker(alpha=0.5, clock=clock, kv_block=BLOCK, fail_on=fail_on)
    pol = make_policy(policy, max_batch=max_batch, token_budget=64, aging_bound_s=None,
                      kv_budget_tokens=budget, kv_block=BLOCK, kv_tree_tokens=TREE,
                      prefill_chunk_tokens=chunk)
    return StepLoop(pol, worker, max_resident=64, clock=clock), worker


def drain(loop: StepLoop, worker: FakeWorker, budget: int, sink) -> int:
    """Run to the end, checking after every step that the loop's count is the worker's and
    (with more than one request resident) within the budget. Returns the most slots held."""
    most = 0
    while loop.step():
        held = worker.kv_tokens()
        assert loop.state.kv_tokens == held
        if len(worker.resident()) > 1:
            assert held <= budget
        most = max(most, held)
    return most


class Tokens(dict):
    def __call__(self, event):
        if isinstance(event, Delta):
            self.setdefault(event.request_id, []).extend(event.token_ids)


@pytest.mark.parametrize("chunk", [0, 24])
def test_requests_wait_while_their_kv_would_not_fit(chunk):
    budget = 300                                   # three starts of 60 + 16 + 16 slots
    loop, worker = make(budget, chunk=chunk)
    sink = Tokens()
    for i in range(6):
        loop.submit(request(f"r{i}", 60, 12), sink)
    most_resident = 0
    while loop.step():
        most_resident = max(most_resident, len(worker.resident()))
        assert loop.state.kv_tokens == worker.kv_tokens() <= budget
    assert most_resident == 3
    for i in range(6):
        assert sink[f"r{i}"] == [token_at(f"r{i}", p) for p in range(12)]
    assert loop.state.kv_tokens == 0 and worker.resident() == []


def test_requests_that_outgrow_the_budget_are_preempted_and_finish_whole():
    budget = 400
    loop, worker = make(budget, policy="las", max_batch=3)
    sink = Tokens()
    for i in range(3):
        loop.submit(request(f"g{i}", 40, 200), sink)      # each ends holding ~240 slots
    most = drain(loop, worker, budget, sink)
    assert most <= budget
    for i in range(3):
        assert sink[f"g{i}"] == [token_at(f"g{i}", p) for p in range(200)]
    again = [rid for rid, _ in worker.prefills]
    assert len(again) > 3                                # someone was preempted and re-prefilled
    assert loop.state.kv_tokens == 0 and loop.admission.live == 0


def test_no_slot_is_leaked_by_cancels_or_failed_steps():
    loop, worker = make(1000, fail_on=lambda items: any(i.request_id == "boom" for i in items))
    sink = Tokens()
    loop.submit(request("a", 30, 50), sink)
    loop.submit(request("b", 30, 50), sink)
    for _ in range(3):
        loop.step()
    loop.cancel("a")
    loop.step()
    assert loop.state.kv_tokens == worker.kv_tokens() > 0
    loop.submit(request("boom", 10, 5), sink)            # its step fails, with b's
    while loop.step():
        pass
    assert loop.state.kv_tokens == worker.kv_tokens() == 0 and worker.resident() == []


def test_the_plan_frees_unchosen_residents_never_served_first_then_the_worst_ranked():
    pol = make_policy("sjf", max_batch=1, token_budget=64, aging_bound_s=None,
                      kv_budget_tokens=300, kv_block=BLOCK, kv_tree_tokens=TREE)
    state = SchedulerState()
    held = {"top": (5, 100, 1), "warm": (50, 100, 0), "bad": (90, 100, 3), "good": (20, 100, 3)}
    for rid, (predicted, kv, steps) in held.items():
        s = RequestStats(rid, "t", 0.0, prompt_len=50, max_tokens=500, predicted_len=predicted)
        s.kv_tokens, s.n_steps = kv, steps
        pol.add(state, s)
    state.kv_tokens = 400
    plan = pol.plan(state, 1.0)
    assert plan.request_ids == ["top"]
    # top may grow (50 + its tree fit its 100 slots: no); 400 > 300: free the never-served one
    assert plan.evict == ["warm"]
    state.requests["top"].committed = 60                 # now it grows by a block
    plan = pol.plan(state, 2.0)
    assert plan.evict == ["warm", "bad"]


def test_a_request_larger_than_the_budget_still_runs_alone():
    loop, worker = make(50)
    sink = Tokens()
    loop.submit(request("big", 100, 5), sink)
    loop.submit(request("small", 5, 5), sink)
    while loop.step():
        assert len(worker.resident()) <= 1
    assert sink["big"] == [token_at("big", p) for p in range(5)]
    assert sink["small"] == [token_at("small", p) for p in range(5)]


@pytest.mark.parametrize("budget,want", [(300, ["r1", "r2"]), (500, ["n1", "r1"])])
def test_a_start_waits_unless_it_fits_and_residents_fill_the_batch_meanwhile(budget, want):
    """A start takes room only the budget has left (no resident is evicted to make room for a
    start: that thrashes); until then the batch goes on with requests that hold KV."""
    pol = make_policy("sjf", max_batch=2, token_budget=64, aging_bound_s=None,
                      kv_budget_tokens=budget, kv_block=BLOCK, kv_tree_tokens=TREE)
    state = SchedulerState()
    for rid, predicted, prompt, kv in (("n1", 1, 200, 0), ("r1", 50, 50, 100), ("r2", 60, 50, 100),
                                       ("r3", 70, 50, 0)):
        s = RequestStats(rid, "t", 0.0, prompt_len=prompt, max_tokens=500, predicted_len=predicted)
        s.kv_tokens = kv
        pol.add(state, s)
    state.kv_tokens = 200
    plan = pol.plan(state, 1.0)
    assert plan.request_ids == want and plan.evict == []


def test_a_large_start_is_not_passed_over_past_the_aging_bound_by_smaller_ones():
    """Smaller arrivals keep fitting where a large one does not; aging's promotion starts it
    anyway, and the planner frees residents' KV for it."""
    clock = FakeClock()
    worker = FakeWorker(alpha=0.5, clock=clock, kv_block=BLOCK)
    pol = make_policy("fcfs", max_batch=4, token_budget=64, aging_bound_s=1.0,
                      kv_budget_tokens=300, kv_block=BLOCK, kv_tree_tokens=TREE)
    loop = StepLoop(pol, worker, max_resident=64, clock=clock)
    sink = Tokens()
    loop.submit(request("s0", 30, 20), sink)
    loop.submit(request("s1", 30, 20), sink)
    loop.step()
    loop.submit(request("big", 200, 5), sink)
    n, t0 = 2, clock.now
    for i in range(2000):
        if i % 4 == 0:
            while loop.admission.live < 8:
                loop.submit(request(f"s{n}", 30, 10 + (n * 7) % 31), sink)
                n += 1
        loop.step()
        if "big" not in loop.state.requests:
            break
    assert sink["big"] == [token_at("big", p) for p in range(5)]
    assert clock.now - t0 < 4.0                          # was ~27 s of simulated time
