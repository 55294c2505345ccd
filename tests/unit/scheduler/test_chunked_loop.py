"""Chunked prefill through the planner and the step loop (fake worker): running streams keep
getting tokens while a long prompt is prefilled, chunks resume where they stopped, the budget is
filled in plan order, and nothing leaks when a request is cancelled, evicted or fails mid-prefill."""
from __future__ import annotations

import pytest

from scheduler.loop import Delta, StepLoop
from scheduler.policies import make_policy
from scheduler.policies.step_budget import chunk_budget
from scheduler.request import Request, RequestStats
from scheduler.state import SchedulerState
from workers.contract import NO_SPECULATION
from workers.fake_worker import FakeClock, FakeWorker, token_at

CHUNK = 16


def request(rid: str, prompt_len: int, max_tokens: int = 30, arrival: float = 0.0,
            predicted: int | None = None) -> Request:
    stats = RequestStats(rid, "t", arrival, prompt_len=prompt_len, max_tokens=max_tokens,
                         predicted_len=predicted)
    return Request(stats, prompt_ids=list(range(3, 3 + prompt_len)))


class Steps:
    """A sink that records, per loop step, which requests got tokens."""

    def __init__(self):
        self.tokens: dict[str, list[int]] = {}
        self.got: set[str] = set()

    def __call__(self, event):
        if isinstance(event, Delta):
            self.tokens.setdefault(event.request_id, []).extend(event.token_ids)
            self.got.add(event.request_id)


def make(policy="fcfs", *, max_batch=4, max_resident=8, chunk=CHUNK, worker=None, **cfg):
    clock = FakeClock()
    worker = worker or FakeWorker(alpha=0.5, clock=clock)
    pol = make_policy(policy, max_batch=max_batch, token_budget=64, aging_bound_s=None,
                      prefill_chunk_tokens=chunk, **cfg)
    return StepLoop(pol, worker, max_resident=max_resident, clock=clock), worker


def test_running_streams_get_a_token_every_step_while_a_long_prompt_is_prefilled():
    loop, worker = make()
    sink = Steps()
    for rid in ("a", "b"):
        loop.submit(request(rid, 8, max_tokens=200), sink)
    for _ in range(3):
        loop.step()
    loop.submit(request("long", 500, max_tokens=5), sink)
    steps_until_first = 0
    while "long" not in sink.tokens:
        sink.got.clear()
        assert loop.step()
        steps_until_first += 1
        assert {"a", "b"} <= sink.got              # never stalled
    # 499 context tokens, at most CHUNK a step, fewer as the context grows (its attention costs)
    assert steps_until_first > -(-499 // CHUNK)
    while loop.step():
        pass
    for rid, n in (("a", 200), ("b", 200), ("long", 5)):
        assert sink.tokens[rid] == [token_at(rid, p) for p in range(n)]
    assert worker.resident() == []


def test_whole_prefill_is_kept_for_comparison():
    loop, worker = make(chunk=0)
    loop.submit(request("long", 500, max_tokens=3), Steps())
    loop.step()
    assert worker.prefills == [("long", 500)]
    assert loop.state.requests["long"].committed >= 1   # prefilled whole, then its first step
    assert loop.state.requests["long"].prefill_left == 0


def test_the_budget_goes_to_chosen_requests_in_plan_order_and_one_left_without_waits():
    pol = make_policy("fcfs", max_batch=4, token_budget=64, aging_bound_s=None, prefill_chunk_tokens=20,
                      prefill_keys_per_row=float("inf"))
    state = SchedulerState()
    for i, (rid, n) in enumerate((("run", 10), ("p1", 30), ("p2", 100), ("p3", 50), ("p4", 20))):
        s = RequestStats(rid, "t", float(i), prompt_len=n, max_tokens=10)
        pol.add(state, s)
    state.requests["run"].prefill_left = 0           # decoding already
    plan = pol.plan(state, 10.0)
    # three wait for their context: 20 each, 60 in all; run decodes, p1 takes its 29 (and
    # decodes in the same step), p2 gets the last 31; p3 waits
    assert plan.request_ids == ["run", "p1", "p2"]
    assert plan.prefill == [0, 29, 31] and plan.warm == 0
    assert plan.budgets[2] == NO_SPECULATION            # no root yet: no tree
    assert plan.budgets[0].max_nodes > 0
    # completing its context this step, p1 verifies its root alone: a tree's rows would attend
    # over its whole context in the step that carries its deepest chunk
    assert plan.budgets[1] == NO_SPECULATION


def test_spare_budget_prefills_requests_admitted_ahead_of_their_turn():
    pol = make_policy("fcfs", max_batch=1, token_budget=64, aging_bound_s=None, prefill_chunk_tokens=32,
                      prefill_keys_per_row=float("inf"))
    state = SchedulerState()
    for i, rid in enumerate(("first", "early", "later")):
        pol.add(state, RequestStats(rid, "t", float(i), prompt_len=50, max_tokens=10))
    state.requests["first"].prefill_left = 0
    for rid in ("early", "later"):
        state.requests[rid].prefill_left = 49
        state.requests[rid].kv_tokens = 64               # resident: the loop admitted it
        pol.prefilling(rid)
    plan = pol.plan(state, 10.0)
    assert plan.request_ids == ["first", "early"] and plan.prefill == [0, 32] and plan.warm == 1
    state.requests["early"].prefill_left = 17
    plan = pol.plan(state, 11.0)
    assert plan.request_ids == ["first", "early", "later"] and plan.prefill == [0, 17, 15]
    assert plan.warm == 2


def test_a_request_cancelled_mid_prefill_frees_its_kv_and_its_slot():
    loop, worker = make()
    sink = Steps()
    loop.submit(request("a", 5, max_tokens=50), sink)
    loop.submit(request("long", 400), sink)
    for _ in range(4):
        loop.step()
    assert "long" in worker.resident() and loop.state.requests["long"].prefill_left > 0
    loop.cancel("long")
    loop.step()
    assert "long" not in worker.resident() and "long" not in loop.state.requests
    assert loop.admission.live == 1
    while loop.step():
        pass
    assert worker.resident() == [] and loop.admission.live == 0


def test_a_chunk_deep_in_a_long_prompt_is_shorter():
    """Its attention reads every earlier key: k tokens after o count k × (1 + o / keys_per_row)."""
    pol = make_policy("fcfs", max_batch=2, token_budget=64, aging_bound_s=None, prefill_chunk_tokens=40,
                      prefill_keys_per_row=1000)
    state = SchedulerState()
    for i, rid in enumerate(("run", "long")):
        pol.add(state, RequestStats(rid, "t", float(i), prompt_len=4001, max_tokens=10))
    state.requests["run"].prefill_left = 0
    state.requests["long"].prefill_left = 4000
    assert pol.plan(state, 1.0).prefill == [0, 40]
    state.requests["long"].prefill_left = 1000          # 3,000 tokens in: each counts 4
    assert pol.plan(state, 2.0).prefill == [0, 10]


def test_the_chunk_weight_comes_from_the_measured_chunk_cost():
    """Without a keys-per-row setting, the step cost's measured chunk fit sets it: attention
    four times dearer per key (row_s ÷ key_s = 250) makes a chunk 3,000 tokens in count 13."""
    from scheduler.profile import StepCostModel

    cost = StepCostModel([(1, [1, 64], [0.01, 0.05]), (2, [2, 64], [0.012, 0.055])],
                         chunk=(1e-3, 4e-6))
    pol = make_policy("fcfs", max_batch=2, token_budget=64, aging_bound_s=None,
                      prefill_chunk_tokens=40, step_cost=cost)
    assert pol.budget.keys_per_row == pytest.approx(250)
    state = SchedulerState()
    for i, rid in enumerate(("run", "long")):
        pol.add(state, RequestStats(rid, "t", float(i), prompt_len=4001, max_tokens=10))
    state.requests["run"].prefill_left = 0
    state.requests["long"].prefill_left = 1000
    assert pol.plan(state, 1.0).prefill == [0, 3]        # 40 // 13
    unmeasured = make_policy("fcfs", max_batch=2, prefill_chunk_tokens=40,
                             step_cost=StepCostModel([(1, [1, 64], [0.01, 0.05])]))
    assert unmeasured.budget.keys_per_row == 1000               # DEFAULT_KEYS_PER_ROW


def test_a_step_in_which_nobody_decodes_prefills_larger_chunks():
    loop, worker = make()
    loop.submit(request("long", 1000, max_tokens=2), Steps())
    loop.step()
    assert loop.state.requests["long"].prefill_left == 999 - 8 * CHUNK


def test_a_request_evicted_mid_prefill_starts_again_and_its_output_is_whole():
    loop, worker = make("sjf", max_batch=2, max_resident=2)
    sink = Steps()
    loop.submit(request("run", 4, max_tokens=60, predicted=1), sink)
    loop.step()                                          # decoding from here on
    loop.submit(request("long", 300, max_tokens=6, predicted=100), sink)
    for _ in range(3):
        loop.step()
    assert 0 < loop.state.requests["long"].prefill_left < 299 - 3 * 15
    # two shorter newcomers outrank it, and the loop's KV limit makes room for them
    for rid in ("x", "y"):
        loop.submit(request(rid, 4, max_tokens=40, predicted=5), sink)
    for _ in range(3):
        loop.step()
    assert "long" not in worker.resident() and loop.state.requests["long"].prefill_left is None
    while loop.step():
        pass
    assert sink.tokens["long"] == [token_at("long", p) for p in range(6)]
    assert [n for rid, n in worker.prefills if rid == "long"] == [300, 300]
    assert worker.resident() == []


def test_a_step_that_fails_mid_prefill_ends_its_batch_and_frees_everything():
    clock = FakeClock()
    worker = FakeWorker(clock=clock, fail_on=lambda items: any(i.prefill for i in items))
    loop, _ = make(worker=worker)
    sink = Steps()
    loop.submit(request("long", 100), sink)
    loop.submit(request("a", 5), sink)
    loop.step()                                          # both prompts' chunks: the step fails
    assert loop.state.requests == {} and worker.resident() == [] and loop.admission.live == 0


@pytest.mark.parametrize("chunk", [-1])
def test_a_negative_budget_is_refused(chunk):
    with pytest.raises(ValueError, match="prefill_chunk_tokens"):
        make_policy("fcfs", prefill_chunk_tokens=chunk)



def test_a_heavy_chunk_still_advances_by_a_token_when_the_budget_is_nearly_spent():
    """token_budget 2 with one request decoding leaves 1 token a step, and a chunk's weight is
    above 1 after its first token: it must still advance (it waited until the other finished)."""
    clock = FakeClock()
    worker = FakeWorker(alpha=0.5, clock=clock)
    pol = make_policy("fcfs", max_batch=2, token_budget=2, aging_bound_s=None, prefill_chunk_tokens=24)
    loop = StepLoop(pol, worker, max_resident=8, clock=clock)
    sink = Steps()
    loop.submit(request("a", 10, max_tokens=400), sink)
    loop.step()
    loop.step()
    loop.submit(request("b", 50, max_tokens=5), sink)
    for _ in range(60):
        loop.step()
    assert sink.tokens.get("b") == [token_at("b", p) for p in range(5)]
    assert len(sink.tokens["a"]) < 400                   # b did not wait for a to finish


def test_a_plan_with_nothing_runnable_lets_the_loop_wait_instead_of_spinning():
    clock = FakeClock()
    worker = FakeWorker(clock=clock, context_limit=16384)
    loop, _ = make(chunk=1, worker=worker)
    loop.submit(request("long", 9000, max_tokens=2), Steps())
    steps = 0
    while loop.step():
        steps += 1
        assert steps < 20_000
    assert "long" not in loop.state.requests             # it finished, a token at least a step


class _Lengths:
    """A length learner stand-in with weights, so the loop prefills arrivals ahead of their turn."""
    weights = object()

    def start(self): pass
    def stop(self): pass
    def note(self, *a): pass
    def belief(self, *a): return None
    def finish(self, *a, **k): pass
    def forget(self, *a): pass


def test_a_request_prefilled_ahead_of_its_turn_and_evicted_is_not_prefilled_again_in_that_step():
    clock = FakeClock()
    worker = FakeWorker(alpha=0.5, clock=clock, kv_block=16)
    pol = make_policy("fcfs", max_batch=1, token_budget=64, aging_bound_s=None, kv_budget_tokens=290,
                      kv_block=16, kv_tree_tokens=16, prefill_chunk_tokens=8)
    loop = StepLoop(pol, worker, max_resident=64, clock=clock, lengths=_Lengths())
    sink = Steps()
    loop.submit(request("a", 40, max_tokens=300), sink)
    for _ in range(3):
        loop.step()
    loop.submit(request("warm", 200, max_tokens=10), sink)     # fits now; a's growth later evicts it
    while loop.step():
        pass
    assert [n for rid, n in worker.prefills].count(200) <= 3    # was: re-prefilled every step
    assert sink.tokens["warm"] == [token_at("warm", p) for p in range(10)]


def test_a_request_deep_into_a_long_context_gets_a_smaller_tree():
    """Its nodes' rows attend over every earlier key: past SHALLOW_CONTEXT a node must be worth
    (keys_per_row + context) ÷ (keys_per_row + SHALLOW_CONTEXT) times more."""
    from scheduler.alpha import AlphaEstimate

    def budgets(prompt_len):
        pol = make_policy("fcfs", max_batch=2, token_budget=64, aging_bound_s=None)
        state = SchedulerState()
        for i, (rid, n) in enumerate((("short", 100), ("other", prompt_len))):
            s = RequestStats(rid, "t", float(i), prompt_len=n, max_tokens=10)
            s.estimate = AlphaEstimate(accepted=7.0, rejected=3.0)       # α̂ 0.71
            pol.add(state, s)
        return [b.max_nodes for b in pol.plan(state, 1.0).budgets]

    shallow, deep = budgets(100), budgets(4000)
    assert shallow[0] == shallow[1] > 0
    # 4,000 tokens in, a node must be worth 3.3× as much: 0.71^d ≥ 0.33 instead of ≥ 0.1
    assert (shallow[1], deep[1]) == (6, 3)
    assert deep[0] >= shallow[0]                        # the nodes it leaves go to the other


@pytest.mark.parametrize("per_request, decoding, waiting, expected", [
    (24, 4, 1, 24),      # one long prompt beside running streams: one chunk a step (stall bound)
    (24, 4, 2, 48),      # each waiting slot advances by a chunk
    (24, 5, 3, 59),      # within the rows the roots leave of the token budget
    (24, 64, 1, 0),      # roots fill the budget: no chunk
    (24, 0, 2, 192),     # nobody decodes: IDLE_CHUNKS chunks
    (24, 0, 10, 240),    # ... or one per waiting request, if more
])
def test_chunk_budget_gives_each_waiting_request_a_chunk_within_the_token_budget(
        per_request, decoding, waiting, expected):
    assert chunk_budget(per_request, 64, decoding, waiting) == expected


def test_a_full_batch_of_new_requests_prefills_a_chunk_for_each():
    """Past saturation a batch holds several requests waiting for their context: the step
    prefills a chunk's worth for each, so starts are not rationed to one chunk a step; they take
    it in plan order (the first finishes its context, and starts decoding, soonest)."""
    pol = make_policy("fcfs", max_batch=4, token_budget=64, aging_bound_s=None, prefill_chunk_tokens=16,
                      prefill_keys_per_row=float("inf"))
    state = SchedulerState()
    for i, rid in enumerate(("run", "p1", "p2", "p3")):
        pol.add(state, RequestStats(rid, "t", float(i), prompt_len=200, max_tokens=10))
    state.requests["run"].prefill_left = 0
    plan = pol.plan(state, 10.0)
    assert plan.request_ids == ["run", "p1"]
    assert plan.prefill == [0, 48]
    state.requests["p1"].prefill_left = 10             # nearly done: the rest goes on down
    plan = pol.plan(state, 11.0)
    assert plan.request_ids == ["run", "p1", "p2"]
    assert plan.prefill == [0, 10, 38]
