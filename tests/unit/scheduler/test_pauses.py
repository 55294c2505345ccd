"""Paused requests (scheduler/policies/pauses.py): a request whose stream's reader fell behind is
not planned, aged, promoted or charged while paused, holds no KV, still ends on a cancel, and
comes back with its place and its tokens as they were."""
from __future__ import annotations

import pytest

from scheduler.policies import make_policy
from scheduler.request import Status
from sched_helpers import build, stats, step
from tests.unit.scheduler.test_step_loop import Collector, make_loop, request, run_to_end, truth


def test_a_paused_request_is_not_planned_while_the_others_are():
    p = make_policy("las", max_batch=2, token_budget=64, aging_bound_s=None)
    state = build(p, [stats(r, tenant=t) for r, t in (("a", "x"), ("b", "x"), ("c", "y"))])
    assert p.pauses.pause(state, "a", 0.0) is state.paused["a"]
    for i in range(5):
        plan = step(p, state, 0.1 * i)
        assert "a" not in plan.request_ids and set(plan.request_ids) == {"b", "c"}
    assert state.paused["a"].n_steps == 0 and "a" not in state.requests
    assert p.pauses.pause(state, "a", 1.0) is None               # already paused: nothing


def test_fast_path_leaves_the_paused_out_too():
    """Everyone fits one batch (the plan takes them all without ranking): not the paused one."""
    p = make_policy("fcfs", max_batch=8, token_budget=64, aging_bound_s=None)
    state = build(p, [stats("a"), stats("b")])
    p.pauses.pause(state, "b", 0.0)
    assert step(p, state, 0.0).request_ids == ["a"]


def test_a_resumed_request_gets_its_place_back():
    """Under LAS the least served runs first: "a", paused with little service, comes back ahead
    of the others that ran meanwhile; its key and attained service are what they were."""
    p = make_policy("las", max_batch=1, token_budget=64, aging_bound_s=None)
    state = build(p, [stats("a", attained=4, taus=(2,)), stats("b", attained=40, taus=(2,) * 10),
                      stats("c", attained=40, taus=(2,) * 10)])
    key = p.queues.rank("a")
    p.pauses.pause(state, "a", 5.0)
    for i in range(6):
        assert step(p, state, 5.0 + 0.1 * i).request_ids != ["a"]
    attained = state.paused["a"].attained
    resumed = p.pauses.resume(state, "a", 6.0)
    assert resumed is state.requests["a"] and "a" not in state.paused and not p.pauses
    assert resumed.attained == attained and p.queues.rank("a") == key
    assert step(p, state, 6.0).request_ids == ["a"]


def test_a_paused_request_is_not_aged_and_its_pause_is_no_wait():
    """With an aging bound, a request paused far past it is not promoted while paused, and
    once resumed its gap counts only the time it waited unpaused: it is not promoted at once
    ahead of a request that really waited."""
    p = make_policy("las", max_batch=1, token_budget=64, aging_bound_s=1.0)
    state = build(p, [stats("a", taus=(2,)), stats("b", taus=(2,))])
    for i in range(3):
        step(p, state, 0.1 + 0.1 * i)
    served_at = state.requests["a"].last_served_s
    p.pauses.pause(state, "a", served_at)
    now = served_at
    for _ in range(100):                            # 10 s paused: ten times the bound
        plan = step(p, state, now)
        assert plan.request_ids == ["b"] and plan.aged == 0
        now += 0.1
    s = p.pauses.resume(state, "a", now)
    assert s.paused_s == pytest.approx(now - served_at)
    assert s.wait_s(now) == pytest.approx(0.0)     # the pause is not a wait
    assert p.aging.due(("default",), state, now, 1) == []
    assert s.max_wait_s < 1.0


def test_the_total_wait_bound_leaves_the_pause_out():
    p = make_policy("las", max_batch=1, token_budget=64, aging_bound_s=None, total_wait_bound_s=2.0)
    state = build(p, [stats("a", taus=(2,)), stats("b")])
    p.pauses.pause(state, "a", 0.2)
    p.pauses.resume(state, "a", 50.0)
    assert "a" not in p.aging.indexes["default"].past_total(50.0, 4)


def test_cancelling_a_paused_request_ends_it():
    p = make_policy("las", max_batch=2, token_budget=64, aging_bound_s=None)
    state = build(p, [stats("a"), stats("b")])
    p.pauses.pause(state, "a", 0.0)
    s = p.remove(state, "a", Status.CANCELLED, None, 1.0)
    assert s is not None and s.status is Status.CANCELLED and not state.paused and not p.pauses
    assert p.pauses.resume(state, "a", 2.0) is None and "a" not in state.requests


def test_the_loop_pauses_frees_kv_and_resumes_with_every_token():
    """Through the inbox: a paused request gets no steps and holds no KV while another runs to
    its end; resumed, it is prefilled again and its tokens go on where they stopped."""
    loop = make_loop("laps", max_batch=4)
    sink = Collector()
    for rid in ("slow", "other"):
        loop.submit(request(rid, max_tokens=200 if rid == "other" else 60), sink)
    for _ in range(3):
        loop.step()
    before = len(sink.tokens["slow"])
    assert before > 0 and "slow" in loop.kv
    loop.pause("slow")
    while "other" not in sink.finished:
        assert loop.step()
        assert "slow" not in loop.state.requests and "slow" not in loop.kv
    assert len(sink.tokens["slow"]) == before and "slow" in loop.state.paused
    assert loop.state.paused["slow"].kv_tokens == 0
    assert not loop.step()                          # only a paused request: nothing to do
    loop.pause("slow", False)
    run_to_end(loop)
    assert sink.tokens["slow"] == truth("slow", 60) and sink.finished["slow"].status is Status.FINISHED
    assert not loop.state.paused and not loop.state.requests


def test_the_loop_cancels_a_paused_request():
    loop = make_loop("laps")
    sink = Collector()
    loop.submit(request("r", max_tokens=50), sink)
    loop.step()
    loop.pause("r")
    loop.step()
    loop.cancel("r")
    loop.pause("r", False)                          # resumed after its end: nothing happens
    run_to_end(loop)
    assert sink.finished["r"].status is Status.CANCELLED
    assert not loop.state.paused and not loop.state.requests and not loop.policy.pauses
