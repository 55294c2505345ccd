"""`specgate sim --tiers`: requests sold a service tier, judged against the gateway's objectives."""
from dataclasses import replace

import pytest

from gateway.tiers import DEFAULT_TIERS
from scheduler.events import Delta, Finished
from scheduler.request import RequestStats, Status
from tools.sim import SimSettings, run_sim
from tools.sim_slo import TierObjectivesMet, assign_tiers, parse_tiers
from workers.fake_worker import FakeClock


def test_tier_shares_parse_and_bad_ones_are_refused():
    assert parse_tiers("priority=0.2, default=0.5,flex=0.3") == (
        ("priority", 0.2), ("default", 0.5), ("flex", 0.3))
    for bad in ("gold=1", "priority=0.5,flex=0.4", "priority=-0.5,flex=1.5", ""):
        with pytest.raises(ValueError):
            parse_tiers(bad)


def test_tiers_are_drawn_by_share_from_their_own_stream():
    tiers = assign_tiers(20_000, parse_tiers("priority=0.2,default=0.5,flex=0.3"), seed=1)
    assert tiers == assign_tiers(20_000, parse_tiers("priority=0.2,default=0.5,flex=0.3"), seed=1)
    assert tiers.count("priority") / 20_000 == pytest.approx(0.2, abs=0.01)
    assert tiers.count("flex") / 20_000 == pytest.approx(0.3, abs=0.01)


def _ended(slo, clock, rid, tier, max_wait_s=0.0, prompt_len=4):
    s = RequestStats(rid, "t", 0.0, prompt_len=prompt_len, max_tokens=64, tier=tier)
    s.max_wait_s, s.committed = max_wait_s, 10
    s.end(Status.FINISHED, "stop", clock.now)
    slo.event(Finished(rid, s.status, "stop", s, None))


def test_a_request_meets_its_tier_only_within_every_objective():
    clock = FakeClock(0.0)
    slo = TierObjectivesMet(clock, aging_bound_s=60.0)
    o = DEFAULT_TIERS["priority"]
    for rid, first, gap in (("fast", 0.5 * o.ttft_s, 0.5 * o.tbt_s),
                            ("late", 2 * o.ttft_s, 0.5 * o.tbt_s),
                            ("choppy", 0.5 * o.ttft_s, 3 * o.tbt_s)):
        slo.arrived(RequestStats(rid, "t", 0.0, prompt_len=4, max_tokens=64, tier="priority"))
        clock.now = first
        slo.event(Delta(rid, (7,), None))
        for _ in range(5):
            clock.now += 2 * gap
            slo.event(Delta(rid, (7, 7), None))          # two tokens: each counts half the gap
        _ended(slo, clock, rid, "priority")
    # on time to its first token, but it waited past the aging bound between two steps
    slo.arrived(RequestStats("starved", "t", clock.now, prompt_len=4, max_tokens=64, tier="priority"))
    slo.event(Delta("starved", (7,), None))
    _ended(slo, clock, "starved", "priority", max_wait_s=61.0)   # past the aging bound
    out = slo.summary(end_s=clock.now)
    assert out["slo_attainment"] == {"priority": 0.25}
    assert out["goodput_tok_s"] == pytest.approx(10 / clock.now)


def test_tiers_are_served_in_order_and_judged_per_policy():
    # two sequences a step near capacity, where the order of service matters: every policy plans
    # the priority tier first and flex with what is left, so their first tokens come in that order
    s = SimSettings(n_requests=300, load=0.95, max_batch=2, calibration_requests=200,
                    calibration_steps=3000, tiers=parse_tiers("priority=0.2,default=0.5,flex=0.3"))
    r = run_sim(["fcfs", "priority"], s)
    assert r["settings"]["tiers"] == {"priority": 0.2, "default": 0.5, "flex": 0.3}
    for p in r["policies"].values():
        assert set(p["slo_attainment"]) == {"priority", "default", "flex"}
        assert all(0 <= v <= 1 for v in p["slo_attainment"].values())
        assert 0 < p["goodput_tok_s"] <= p["committed_tokens_per_s"]
        ttft = p["per_tier_mean_ttft_s"]
        assert ttft["priority"] < ttft["default"] < ttft["flex"]
        assert 0 <= p["slo_attainment_alone"]["priority"] <= 1
    untiered = run_sim(["fcfs"], replace(s, tiers=()))["policies"]["fcfs"]
    assert "slo_attainment" not in untiered and "slo_attainment_alone" not in untiered
    # every request of the top tier: the run without the lower tiers is the same run
    top = run_sim(["fcfs"], replace(s, n_requests=60, tiers=parse_tiers("priority=1")))
    p = top["policies"]["fcfs"]
    assert p["slo_attainment_alone"]["priority"] == p["slo_attainment"]["priority"]


def test_the_simulators_judge_and_the_gateways_agree_on_a_long_prompts_ttft():
    # a first token later than the fixed part but within the prompt's allowance: met by both
    # judges for a long prompt, missed by both for a short one (same request, same step costs)
    from gateway.metrics import GatewayMetrics
    from scheduler.step_cost import LinearStepCost

    cost = LinearStepCost(per_token_s=0.001)
    o = DEFAULT_TIERS["priority"]
    assert o.ttft_prefill_allowance > 0
    first = o.ttft_s + 0.5 * o.ttft_prefill_allowance * cost.prefill(2000)
    clock = FakeClock(0.0)
    sim = TierObjectivesMet(clock, aging_bound_s=60.0, cost=cost)
    gateway = GatewayMetrics(tiers=DEFAULT_TIERS)
    for rid, prompt in (("long", 2000), ("short", 10)):
        clock.now = 0.0
        s = RequestStats(rid, "t", 0.0, prompt_len=prompt, max_tokens=64, tier="priority")
        sim.arrived(s)
        times = gateway.times("t", "priority", prompt_tokens=prompt, step_cost=cost)
        clock.now = first
        sim.event(Delta(rid, (7,), None))
        times.first_token(first)
        _ended(sim, clock, rid, "priority", prompt_len=prompt)
        times.ended(first)

    def met(result):
        return gateway.registry.get_sample_value("specgate_slo_requests_total", {
            "tenant": "t", "tier": "priority", "objective": "ttft", "result": result})

    assert sim.summary(end_s=clock.now)["slo_attainment"] == {"priority": 0.5}
    assert (met("met"), met("missed")) == (1, 1)
