"""The miss predictor (scheduler/miss.py) on hand-computable queues, admission's verdict on it,
and the loop's per-tier view of the queue (scheduler/forecast.py)."""
from __future__ import annotations

import pytest

from scheduler.forecast import MissForecast
from scheduler.miss import Work, backlog, elapse, judge, predict, push
from scheduler.policies import make_policy
from scheduler.request import RequestStats, Status
from scheduler.state import SchedulerState
from scheduler.step_cost import LinearStepCost

OBJ = {"priority": 1.0, "default": 2.5, "flex": 30.0}
FIXED = {t: (seconds, 0.0) for t, seconds in OBJ.items()}   # `configure`: no prefill allowance


def test_an_empty_queue_costs_only_the_newcomers_own_prefill_and_first_step():
    b = backlog([], batch=4, step_s=0.05)
    p = predict(b, "t", steps=10, prefill_s=0.2)
    assert (p.wait_s, p.ttft_s, p.completion_s, p.tenant_share) == pytest.approx((0, 0.25, 0.7, 0))


def test_fewer_requests_ahead_than_the_batch_leave_a_slot_free_at_once():
    b = backlog([Work("a", 100), Work("a", 50)], batch=3, step_s=0.1)
    assert predict(b, "t", steps=1).wait_s == 0


def test_a_full_batch_frees_its_earliest_slot_first():
    # batch 2 at 0.1 s a step: A (20 steps) and B (5) start at once; C (8) takes B's slot at
    # 0.5 s and frees it at 1.3 s; D (3) takes it at 1.3 s -> 1.6 s; A frees at 2.0 s: the
    # newcomer starts at 1.6 s, first token at 1.7 s
    ahead = [Work("a", 20), Work("b", 5), Work("c", 8), Work("d", 3)]
    b = backlog(ahead, batch=2, step_s=0.1)
    assert b.free_s == pytest.approx((1.6, 2.0))
    p = predict(b, "a", steps=4)
    assert (p.wait_s, p.ttft_s, p.completion_s) == pytest.approx((1.6, 1.7, 2.0))
    assert p.tenant_share == pytest.approx(20 / 36)


def test_prefills_in_passes_of_their_own_delay_the_start_as_a_whole():
    b = backlog([Work("a", 10, prefill_s=0.3), Work("b", 2, prefill_s=0.2)], batch=1, step_s=0.1)
    assert predict(b, "t", steps=1).wait_s == pytest.approx(1.2 + 0.5)


def test_a_step_cost_model_prices_the_step():
    cost = LinearStepCost(fixed_s=0.04, per_token_s=0.001)
    step_s = cost(4, 4 * 5)                   # a full batch of 4, 5 tree tokens each: 0.06 s
    b = backlog([Work("a", 10)] * 8, batch=4, step_s=step_s)
    assert predict(b, "t", steps=1, prefill_s=cost.prefill(100)).ttft_s == pytest.approx(
        2 * 10 * 0.06 + 0.14 + 0.06)


def test_push_queues_a_newcomer_ahead_of_later_ones_and_elapse_drains_the_slots():
    b = backlog([Work("a", 10)], batch=2, step_s=0.1)           # slots free at 0, 1.0
    b = push(b, Work("b", 4))                                   # takes the free slot: 0.4
    assert b.free_s == pytest.approx((0.4, 1.0))
    b = push(b, Work("b", 2))                                   # 0.4 -> 0.6
    assert b.free_s == pytest.approx((0.6, 1.0))
    assert predict(b, "b", steps=1).tenant_share == pytest.approx(0.6 / 1.6)
    later = elapse(b, 0.5)
    assert later.free_s == pytest.approx((0.1, 0.5))
    assert later.work_s == pytest.approx(1.6 - 2 * 0.5)
    assert elapse(b, 5).free_s == (0.0, 0.0)


def test_a_predicted_miss_is_refused_with_the_seconds_until_it_would_make_it():
    b = backlog([Work("a", 40)], batch=1, step_s=0.1)            # 4.0 s ahead
    fc = {"default": predict(b, "t", steps=5)}.get
    v = judge("default", fc, OBJ, {"default": "refuse"}, flex_allowed=True)
    assert (v.action, v.status) == ("refuse", 503)
    assert v.retry_after_s == pytest.approx(4.1 - 2.5)
    # retried that much later, with nothing new ahead, it makes it
    fc = {"default": predict(elapse(b, v.retry_after_s), "t", steps=5)}.get
    assert judge("default", fc, OBJ, {"default": "refuse"}, True).action == "admit"


def test_a_tenant_whose_own_requests_make_the_wait_gets_429():
    b = backlog([Work("mine", 30), Work("other", 10)], batch=1, step_s=0.1)
    v = judge("default", lambda t: predict(b, "mine", steps=1), OBJ, {}, True)
    assert (v.action, v.status) == ("refuse", 429)
    v = judge("default", lambda t: predict(b, "other", steps=1), OBJ, {}, True)
    assert (v.action, v.status) == ("refuse", 503)


def test_a_miss_moves_to_flex_only_where_allowed_and_flex_makes_it():
    busy = predict(backlog([Work("a", 40)], batch=1, step_s=0.1), "t", steps=1)
    fc = {"default": busy, "flex": busy}.get
    assert judge("default", fc, OBJ, {"default": "flex"}, True).tier == "flex"
    v = judge("default", fc, OBJ, {"default": "flex"}, flex_allowed=False)
    assert (v.action, v.tier) == ("refuse", "default")
    assert judge("default", fc, {**OBJ, "flex": 3.0}, {"default": "flex"}, True).action == "refuse"
    assert judge("default", fc, OBJ, {"default": "admit"}, True).action == "admit"


def test_no_prediction_or_a_miss_by_its_own_size_is_admitted():
    assert judge("default", lambda t: None, OBJ, {}, True).action == "admit"
    own = predict(backlog([], batch=1, step_s=0.1), "t", steps=1, prefill_s=5.0)
    assert judge("default", lambda t: own, OBJ, {}, True).action == "admit"


def _live(rid, tier, *, max_tokens, tenant="t", arrival=0.0, running=False, steps=0):
    s = RequestStats(rid, tenant, arrival, prompt_len=8, max_tokens=max_tokens, tier=tier)
    if running:
        s.status, s.n_steps, s.tau_sum, s.committed, s.kv_tokens = (
            Status.RUNNING, steps, float(steps), steps, 16)
    return s


def test_the_forecast_puts_a_tier_behind_its_own_and_the_higher_tiers_only():
    planner = make_policy("fcfs", max_batch=1)
    f = MissForecast(planner)
    f.configure(FIXED, {})
    state = SchedulerState(step_s=0.1)
    for s in (_live("p", "priority", max_tokens=11, running=True, steps=1),  # 10 left
              _live("d", "default", max_tokens=20, arrival=1.0),              # 20 to come
              _live("f", "flex", max_tokens=50, arrival=2.0)):
        state.requests[s.request_id] = s
    f.refresh(state, now=100.0)
    ttft = {t: f.predict(t, "x", 8, 4, now=100.0).ttft_s for t in OBJ}
    assert ttft == pytest.approx({"priority": 1.1, "default": 3.1, "flex": 8.1})
    # a priority request admitted now goes ahead of every tier's newcomers; half a second
    # later the slots have drained by that much
    f.admitted(_live("p2", "priority", max_tokens=5), now=100.0)
    ttft = {t: f.predict(t, "x", 8, 4, now=100.5).ttft_s for t in OBJ}
    assert ttft == pytest.approx({"priority": 1.1, "default": 3.1, "flex": 8.1})


def test_a_forecast_without_objectives_or_step_time_predicts_nothing():
    f = MissForecast(make_policy("fcfs", max_batch=1))
    state = SchedulerState(step_s=0.1)
    f.refresh(state, now=0.0)
    assert f.predict("default", "t", 8, 4, now=0.0) is None       # off
    f.configure(FIXED, {})
    f.refresh(SchedulerState(), now=0.0)                           # no step measured, no cost
    assert f.predict("default", "t", 8, 4, now=0.0) is None


def test_a_priority_newcomer_is_never_refused_for_the_lower_tiers_load():
    planner = make_policy("fcfs", max_batch=1)
    f = MissForecast(planner)
    f.configure(FIXED, {})
    state = SchedulerState(step_s=0.1)
    for i in range(20):                          # 20 s of default and flex work queued
        s = _live(f"d{i}", "default" if i % 2 else "flex", max_tokens=10, arrival=float(i))
        state.requests[s.request_id] = s
    f.refresh(state, now=50.0)

    def forecast(tier):
        return f.predict(tier, "x", 8, 4, now=50.0)

    assert judge("priority", forecast, OBJ, {"priority": "refuse"}, True).action == "admit"
    assert forecast("priority").wait_s == 0
    assert judge("default", forecast, OBJ, {"default": "refuse"}, True).action == "refuse"


def test_a_long_prompt_the_forecast_serves_within_its_scaled_objective_is_admitted():
    # its own prefill fits the fixed part, its wait does not: refused on the fixed part alone,
    # admitted once the objective grows with its prompt (`ttft_objective_s`)
    cost = LinearStepCost(per_token_s=0.001)
    planner = make_policy("fcfs", max_batch=1, step_cost=cost)
    state = SchedulerState(step_s=0.1)
    ahead = _live("d", "default", max_tokens=6, running=True, steps=1)     # 0.5 s to go
    state.requests[ahead.request_id] = ahead
    for allowance, action in ((0.0, "refuse"), (1.0, "admit")):
        f = MissForecast(planner)
        f.configure({"default": (1.0, allowance)}, {"default": "refuse"})
        f.refresh(state, now=10.0, force=True)
        p = f.predict("default", "x", 800, 4, now=10.0)
        assert p.ttft_s - p.wait_s < 1.0 < p.ttft_s < 1.0 + cost.prefill(800)
        v = judge("default", lambda t: f.predict(t, "x", 800, 4, now=10.0),
                  f.objectives(800), f.on_miss, False)
        assert v.action == action
