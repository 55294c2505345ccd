"""Each policy's order on hand-built queues, levels, the perceptible switch, aging, priority."""
import math
import random

import pytest

from sched_helpers import build, stats, step
from scheduler.sizing import SizingConfig
from scheduler.state import SchedulerState


def build_empty():
    return SchedulerState()
from scheduler.policies import BAND, POLICIES, PolicyConfig, make_policy
from scheduler.policies.length_model import mean_beyond
from scheduler.request import Status, StepRecord
from scheduler.step_cost import LinearStepCost

NO_AGING = dict(aging_bound_s=None)
FLAT_STEP = LinearStepCost(fixed_s=0.1)         # a step costs 0.1 s, whatever it holds


def order(policy, requests, now=100.0):
    state = build(policy, requests)
    return policy.plan(state, now).request_ids


def ranked(name, requests, **opts):
    """The policy's order: the plan when all but one request fit (a plan that takes everyone
    does not rank them)."""
    batch = max(1, len(requests) - 1)
    return order(make_policy(name, max_batch=batch, **NO_AGING, **opts), requests)


ORDER_CASES = [
    # (policy, options, requests, expected order; the plan leaves out the last)
    ("fcfs", {}, [stats("late", arrival=3), stats("first", arrival=1), stats("mid", arrival=2),
                  stats("last", arrival=4)], ["first", "mid", "late"]),
    ("sjf", {}, [stats("long", predicted=900), stats("none", predicted=None),
                 stats("short", predicted=10), stats("mid", predicted=100)],
     ["short", "mid", "long"]),
    ("sjf", {}, [stats("none", predicted=None, arrival=0), stats("a", predicted=50, arrival=1)],
     ["a", "none"]),
    ("fcfs", {}, [stats("b", arrival=2), stats("a", arrival=1)], ["a", "b"]),
    # las: levels by attained service (16, 64, 256 …), least attained first within a level
    ("las", {}, [stats("l1_small", attained=40), stats("l0_big", attained=30),
                 stats("l0_small", attained=5), stats("l2", attained=200)],
     ["l0_small", "l0_big", "l1_small"]),
    # srpt: the oracle's remaining work, whatever the prediction says
    ("srpt", {"oracle": lambda s: {"a": 30, "b": 10, "c": 20, "d": 40}[s.request_id]},
     [stats(r, predicted=1) for r in "abcd"], ["b", "c", "a"]),
]


@pytest.mark.parametrize("name, opts, requests, expected", ORDER_CASES,
                         ids=[c[0] for c in ORDER_CASES])
def test_policy_order(name, opts, requests, expected):
    assert ranked(name, requests, **opts) == expected[:len(requests) - 1]


def stable(rid, **kw):          # 4 steps of τ = 2: mean 2, stderr 0 → perceptible at once
    return stats(rid, taus=(2, 2, 2, 2), **kw)


def noisy(rid, **kw):           # τ alternating 1, 5: stderr/mean ≈ 0.38 → not perceptible
    return stats(rid, taus=(1, 5, 1, 5), **kw)


LAPS_CASES = [
    # perceptible requests ranked by predicted remaining steps = remaining tokens ÷ mean τ
    ("strict", [stable("p_far", predicted=400), stable("p_near", predicted=20),
                stable("p_mid", predicted=100)], ["p_near", "p_mid", "p_far"]),
    # strict: level 0 first, then perceptible, then lower levels
    ("strict", [noisy("np_l1", attained=40), stable("p", predicted=400),
                stats("new")], ["new", "p", "np_l1"]),
    # unified: a non-perceptible request counts as the steps left in its level (32 − 16 = 16
    # tokens at 4 per step = 4 steps); perceptible ones compete on remaining steps
    ("unified", [stats("np", taus=(1, 5, 1, 5)), stable("p_2", predicted=12),
                 stable("p_50", predicted=108)], ["p_2", "np", "p_50"]),
    # a prediction already overrun counts as half as much again as committed: 10 tokens, 5 steps
    ("strict", [stable("overrun", predicted=5, committed=20), stable("p_30", predicted=68)],
     ["overrun", "p_30"]),
]


@pytest.mark.parametrize("interleave, requests, expected", LAPS_CASES)
def test_laps_order(interleave, requests, expected):
    # levels as LAS's (first quantum 16 tree tokens), so that a case's level is plain to see
    got = ranked("laps", requests, interleave=interleave, min_steps=4, max_rel_stderr=0.2,
                 first_quantum=16.0)
    assert got == expected[:len(requests) - 1]


def test_laps_perceptible_switch_needs_steps_and_a_small_stderr():
    policy = make_policy("laps", max_batch=1, min_steps=4, max_rel_stderr=0.2, **NO_AGING)
    state = build(policy, [stats("a"), stats("b", arrival=1.0)])
    a = state.requests["a"]
    taus = [3, 3, 3, 3]
    for i, tau in enumerate(taus):
        a.record_step(StepRecord("a", 4, tau), i, i + 0.1)
        policy.ordering.refresh(state, a)
        assert a.perceptible == (i + 1 >= 4)
    b = state.requests["b"]
    for i, tau in enumerate([1, 5] * 3):
        b.record_step(StepRecord("b", 4, tau), i, i + 0.1)
        policy.ordering.refresh(state, b)
    assert not b.perceptible                          # stderr/mean = 0.8/3 > 0.2
    b_stats = stats("c", taus=(1, 5) * 20)            # 40 steps: stderr/mean ≈ 0.1
    policy.ordering.refresh(state, b_stats)
    assert b_stats.perceptible


def test_laps_without_prediction_stays_in_the_levels_only_on_raw_predictions():
    # raw predictions have nothing to rank it by; the length model has its max_tokens
    raw, calibrated = stats("x", predicted=None, taus=(2, 2, 2)), stats("y", predicted=None,
                                                                        taus=(2, 2, 2))
    make_policy("laps", min_steps=2, lengths="predicted", **NO_AGING).ordering.refresh(build_empty(), raw)
    make_policy("laps", min_steps=2, **NO_AGING).ordering.refresh(build_empty(), calibrated)
    assert not raw.perceptible and calibrated.perceptible


@pytest.mark.parametrize("name", ["las", "laps"])
def test_demotion_across_levels(name):
    # quanta: level 0 below 10 tokens, level 1 below 20, level 2 below 40, level 3 above
    policy = make_policy(name, max_batch=1, first_quantum=10, growth=2, n_levels=4,
                         **({"min_steps": 10**6} if name == "laps" else {}), **NO_AGING)
    state = build(policy, [stats("old")])
    levels = []
    for i in range(12):                                # each step verifies 1 + 3 = 4 tokens
        policy.plan(state, i)
        policy.update(state, [StepRecord("old", 4, 1)], i + 0.1, 0.1)
        policy.ordering.refresh(state, state.requests["old"])
        levels.append(state.requests["old"].level)
    assert levels == [0, 0, 1, 1, 2, 2, 2, 2, 2, 3, 3, 3]
    policy.add(state, stats("new", arrival=20))
    assert policy.plan(state, 21).request_ids == ["new"]   # a fresh request preempts it


def test_priority_class_zero_first():
    policy = make_policy("fcfs", max_batch=2, **NO_AGING)
    reqs = [stats("c1_early", arrival=0, priority=1), stats("c0_late", arrival=5, priority=0),
            stats("c2", arrival=-1, priority=2)]
    assert order(policy, reqs) == ["c0_late", "c1_early"]
    # and within the batch the plan keeps that order when not everyone fits


@pytest.mark.parametrize("name", ["fcfs", "sjf", "las", "laps"])
def test_aging_bound_lets_a_starved_request_jump_ahead(name):
    # max_batch 1; "starved" has the worst key in every policy; each step a better request
    # arrives (and finishes in one step, so the engine is not overloaded)
    bound = 5.0
    policy = make_policy(name, max_batch=1, aging_bound_s=bound, aging_margin_steps=1)
    state = build(policy, [stats("starved", arrival=0.0, predicted=10_000, attained=10**5)])
    state.requests["starved"].arrival_s = 1e9 if name == "fcfs" else 0.0   # last for fcfs
    policy.rebuild(state)
    served_at, now = [], 0.0
    for i in range(200):
        policy.add(state, stats(f"n{i}", arrival=now, predicted=1))
        plan = step(policy, state, now, step_s=0.1, finish=set(state.requests) - {"starved"})
        if plan.request_ids == ["starved"]:
            served_at.append(now)
            assert plan.aged == 1
        now += 0.1
    assert served_at, "never served"
    assert state.requests["starved"].max_wait_s <= bound + 1e-9
    gaps = [b - a for a, b in zip([0.0] + served_at, served_at)]
    assert max(gaps) <= bound


def test_plan_respects_batch_and_token_budget():
    rng = random.Random(7)
    for trial in range(200):
        name = rng.choice(["fcfs", "sjf", "las", "laps"])
        budget, batch = rng.randint(1, 80), rng.randint(1, 16)
        policy = make_policy(name, max_batch=batch, token_budget=budget,
                             sizing=SizingConfig(max_tree_tokens=rng.randint(0, 16)), **NO_AGING)
        reqs = [stats(f"r{i}", tenant=rng.choice("abc"), arrival=rng.random(),
                      predicted=rng.randint(1, 500),
                      taus=tuple(rng.randint(1, 5) for _ in range(rng.randint(0, 6))))
                for i in range(rng.randint(0, 40))]
        p = policy.plan(build(policy, reqs), 1.0)
        assert len(p) == min(len(reqs), batch, budget) and len(set(p.request_ids)) == len(p)
        assert p.tokens <= budget
        assert all(b.max_depth <= b.max_nodes for _, b in p.entries)


def test_update_tracks_running_preempted_and_finished():
    policy = make_policy("fcfs", max_batch=1, **NO_AGING)
    state = build(policy, [stats("a", arrival=0), stats("b", arrival=1)])
    step(policy, state, 2.0)
    assert state.running == {"a"} and state.requests["a"].status is Status.RUNNING
    policy.add(state, stats("c", arrival=-1))                   # jumps ahead of a (fcfs key)
    step(policy, state, 3.0)
    assert state.requests["a"].status is Status.PREEMPTED and state.running == {"c"}
    plan = policy.plan(state, 4.0)
    finished = policy.update(state, [StepRecord("c", 1, 1, "eos")], 4.1, 0.1)
    assert [s.request_id for s in finished] == ["c"] and "c" not in state.requests
    assert finished[0].finish_reason == "stop" and plan.request_ids == ["c"]


def test_max_tokens_finishes_with_length():
    policy = make_policy("fcfs", **NO_AGING)
    state = build(policy, [stats("a", max_tokens=3)])
    finished = policy.update(state, [StepRecord("a", 4, 3)], 1.0, 0.1)
    assert finished[0].status is Status.FINISHED and finished[0].finish_reason == "length"


def test_cancel_removes_from_queue_and_plan():
    policy = make_policy("sjf", **NO_AGING)
    state = build(policy, [stats("a", predicted=1), stats("b", predicted=2)])
    s = policy.remove(state, "a", Status.CANCELLED, "client_disconnected", 1.0)
    assert s.finish_reason == "abort" and policy.plan(state, 1.0).request_ids == ["b"]
    assert policy.remove(state, "a", Status.CANCELLED, None, 1.0) is None
    # a record for a request cancelled during its step is ignored
    assert policy.update(state, [StepRecord("a", 3, 2)], 2.0, 0.1) == []


def test_rebuild_restores_the_same_order():
    policy = make_policy("laps", max_batch=5, **NO_AGING)
    reqs = [stable(f"p{i}", predicted=10 * i + 5) for i in range(4)] + [stats("new")]
    state = build(policy, reqs)
    before = policy.plan(state, 1.0).request_ids
    fresh = make_policy("laps", max_batch=5, **NO_AGING)
    fresh.rebuild(state)
    assert fresh.plan(state, 1.0).request_ids == before


def test_factory():
    assert set(POLICIES) == {"fcfs", "sjf", "las", "laps", "srpt", "priority"}
    p = make_policy("laps", PolicyConfig(max_batch=4), n_levels=3, token_budget=32)
    assert (p.config.max_batch, p.config.token_budget, p.ordering.levels.n_levels) == (4, 32, 3)
    with pytest.raises(ValueError):
        make_policy("lottery")
    with pytest.raises(TypeError):
        make_policy("fcfs", no_such_option=1)
    with pytest.raises(ValueError):
        make_policy("laps", interleave="sideways")
    assert BAND > 1e9


@pytest.mark.parametrize("name", ["fcfs", "sjf", "las", "laps"])
def test_max_resident_starts_no_request_the_kv_cannot_hold(name):
    # 2 may hold KV and a and b have started; c has the best key in every policy but must wait
    # until one of them finishes, instead of making the step loop evict and re-prefill
    policy = make_policy(name, max_batch=1, max_resident=2, **NO_AGING)
    old = dict(predicted=500, attained=5000, taus=(2, 2))
    state = build(policy, [stats("a", arrival=0, **old), stats("b", arrival=1, **old),
                           stats("c", arrival=-1, predicted=1)])
    for t in range(5):
        assert step(policy, state, t).request_ids != ["c"]
    step(policy, state, 5, finish={"a", "b"})                  # whichever ran ends
    assert step(policy, state, 6).request_ids == ["c"]


def test_max_resident_holds_back_aging_promotions_it_cannot_start():
    policy = make_policy("fcfs", max_batch=1, max_resident=1, aging_bound_s=1.0,
                         aging_margin_steps=0)
    state = build(policy, [stats("a", arrival=0), stats("b", arrival=0.5)])
    step(policy, state, 0.0, step_s=0.1)                       # a starts and holds the KV
    for i in range(1, 30):
        plan = step(policy, state, i * 0.1, step_s=0.1)
        assert plan.request_ids == ["a"]                       # b is overdue but cannot start
    with pytest.raises(ValueError, match="full batch"):
        make_policy("fcfs", max_batch=4, max_resident=2)


def test_laps_learns_lengths_from_finished_requests():
    # the predictor says 50 for everything; this tenant's answers are really 200 tokens
    policy = make_policy("laps", max_batch=1, min_steps=2, **NO_AGING)
    state = build(policy, [stats(f"f{i}", tenant="t", predicted=50) for i in range(40)])
    for i in range(40):
        state.requests[f"f{i}"].committed = 199
        policy.update(state, [StepRecord(f"f{i}", 2, 1, "stop")], 1.0, 0.1)
    fresh = stats("x", tenant="t", predicted=50, taus=(2, 2, 2))
    assert policy.ordering.remaining_tokens(fresh) == pytest.approx(200 - 6, rel=0.05)
    unknown = stats("y", tenant="t", predicted=None, taus=(2, 2, 2))
    policy.ordering.refresh(state, unknown)                             # the tenant's record stands in
    assert unknown.perceptible
    assert make_policy("laps", lengths="predicted").ordering.remaining_tokens(fresh) == 44
    # the record is the tenant's id's: a tenant created again under the name starts without it
    recreated = stats("z", tenant="t", predicted=50, taus=(2, 2, 2))
    recreated.tenant_id = "t-created-again"
    stranger = stats("w", tenant="never-seen", predicted=50, taus=(2, 2, 2))
    assert policy.ordering.remaining_tokens(recreated) == policy.ordering.remaining_tokens(stranger) < 150
    with pytest.raises(ValueError):
        make_policy("laps", lengths="oracle")


def test_laps_without_predictions_or_records_does_not_round_robin_similar_requests():
    # the gateway has no length predictor: before its tenant has a record, a request's max_tokens
    # stands in, so of requests asking for the same bound the one furthest along goes first
    # (least attained service alone would rotate them, finishing every one of them late)
    policy = make_policy("laps", max_batch=1, min_steps=2, **NO_AGING)
    reqs = [stats(f"r{i}", predicted=None, max_tokens=96, arrival=i) for i in range(3)]
    state = build(policy, reqs)
    served = [step(policy, state, 10.0 + t).request_ids[0] for t in range(144)]
    # a newcomer's first quantum (128 tree tokens, 16 steps of 1 + 7) is longer than what r0 has
    # left once its τ is known, so r0 runs to its 96 tokens (48 steps at τ 2), then r1, then r2
    assert served == ["r0"] * 48 + ["r1"] * 48 + ["r2"] * 48
    assert all(policy.ordering.predictable(s) for s in reqs)
    # and a request that asks for fewer tokens ranks ahead of one that asks for many
    short, long_ = stable("short", predicted=None, max_tokens=16), stable("long", predicted=None)
    assert ranked("laps", [long_, short, stats("new", arrival=5)], min_steps=4,
                  max_rel_stderr=0.2)[0] == "short"


def test_laps_counts_a_newcomers_prefill_in_its_first_quantum():
    # on a CPU a 1,000-token prompt's prefill costs as much as many steps: of two newcomers the
    # one with the short prompt is nearer the end of its first quantum, and starts first
    from scheduler.profile import StepCostModel
    cost = StepCostModel([(1, [1, 16], [0.02, 0.03]), (2, [2, 32], [0.03, 0.05])],
                         prefill=([10, 1000], [0.02, 2.0]))
    long_prompt, short_prompt = stats("long_prompt", arrival=0), stats("short_prompt", arrival=1)
    long_prompt.prompt_len, short_prompt.prompt_len = 1000, 10
    got = ranked("laps", [long_prompt, short_prompt], step_cost=cost)
    assert got == ["short_prompt"]
    assert ranked("laps", [long_prompt, short_prompt]) == ["long_prompt"]   # no costs: by arrival
    policy = make_policy("laps", max_batch=2, step_cost=cost)
    assert policy.ordering.prefill_steps(long_prompt) == pytest.approx(2.0 / 0.03)   # in full-batch steps


@pytest.mark.parametrize("came_later_by, weight, cost, first", [
    (30.0, 0.03, FLAT_STEP, "short"),   # 10 + 0.03·30/0.1 = 19 steps < 20: the short one still
    (40.0, 0.03, FLAT_STEP, "long"),    # 10 + 12 = 22 > 20: the long one has waited long enough
    (40.0, 0.0, FLAT_STEP, "short"),    # no credit: shortest remaining first
    (40.0, 0.03, None, "short"),        # no cost model: waiting cannot be put in steps, no credit
])
def test_laps_wait_credit_lets_a_long_request_that_came_much_earlier_go_first(
        came_later_by, weight, cost, first):
    # both perceptible after 4 steps of τ 2 (8 tokens): 40 tokens left is 20 steps, 20 is 10
    long_ = stable("long", arrival=0.0, predicted=48)
    short = stable("short", arrival=came_later_by, predicted=28)
    got = ranked("laps", [long_, short, stats("new", arrival=1000.0)], lengths="predicted",
                 min_steps=4, max_rel_stderr=0.2, wait_weight=weight, step_cost=cost)
    assert got[0] == first


def test_laps_wait_credit_is_not_negative():
    with pytest.raises(ValueError, match="wait_weight"):
        make_policy("laps", wait_weight=-0.1)


def believing(s, remaining: float, sigma: float = 0.3, at: int | None = None):
    """`s` with a re-predicted belief: ln(tokens to come) ~ N(ln remaining, σ²) at `at`."""
    s.length_belief = (math.log(remaining), sigma, s.committed if at is None else at)
    return s


def test_laps_ranks_by_the_re_predicted_remaining_length_and_sjf_by_the_arrival_one():
    """sjf keeps the length predicted at arrival; laps reads what the predictor says now."""
    def requests():
        return [believing(stable("said_short_now_long", predicted=20, committed=8), 400),
                believing(stable("said_long_now_short", predicted=900, committed=8), 6),
                believing(stable("mid", predicted=100, committed=8), 60)]

    assert ranked("sjf", requests()) == ["said_short_now_long", "mid"]
    assert ranked("laps", requests(), min_steps=4, max_rel_stderr=0.2) == [
        "said_long_now_short", "mid"]


def test_laps_remaining_length_from_a_belief_is_its_mean_beyond_what_was_committed_since():
    policy = make_policy("laps", **NO_AGING)
    fresh = believing(stats("a", committed=40, max_tokens=4096), 100, sigma=0.5, at=40)
    later = believing(stats("b", committed=140, max_tokens=4096), 100, sigma=0.5, at=40)
    capped = believing(stats("c", committed=40, max_tokens=60), 100, sigma=0.5, at=40)
    assert policy.ordering.remaining_tokens(fresh) == pytest.approx(mean_beyond(math.log(100), 0.5, 0))
    assert policy.ordering.remaining_tokens(later) == pytest.approx(mean_beyond(math.log(100), 0.5, 100))
    assert policy.ordering.remaining_tokens(capped) <= 20           # never past its max_tokens
    assert policy.ordering.predictable(believing(stats("d", predicted=None), 50))


def test_laps_ranks_newcomers_by_their_prediction_or_by_levels():
    """A newcomer has no τ yet: "predicted" ranks it by predicted remaining tokens (at one per
    step), "levels" by the steps left in its first quantum, whatever its prediction."""
    def newcomers():
        return [stats("long", predicted=2000, arrival=0), stats("short", predicted=10, arrival=1),
                stats("mid", predicted=300, arrival=2)]

    assert ranked("laps", newcomers()) == ["short", "mid"]
    by_levels = ranked("laps", newcomers(), newcomers="levels")
    assert by_levels == ["long", "short"]                      # equal keys: arrival order
    with pytest.raises(ValueError, match="newcomers"):
        make_policy("laps", newcomers="oracle")


@pytest.mark.parametrize("name", ["sjf", "laps"])
def test_total_wait_bound_promotes_a_request_once_its_waiting_passes_it(name):
    """The gap bound (2 s) lets a long request wait 2 s at a time while shorter ones keep
    arriving; a total bound of 1 s promotes it once its waiting since arrival passes 1 s, and
    again whenever it has waited longest of those past the bound (by total waiting, as FCFS)."""
    def run(total):
        policy = make_policy(name, max_batch=1, aging_bound_s=2.0, aging_margin_steps=1,
                             total_wait_bound_s=total)
        state = build(policy, [stats("long", arrival=0.0, predicted=10_000)])
        served, now = [], 0.0
        for i in range(30):
            policy.add(state, stats(f"n{i}", arrival=now, predicted=1))
            plan = step(policy, state, now, step_s=0.1, finish=set(state.requests) - {"long"})
            served += [round(now, 1)] if plan.request_ids == ["long"] else []
            now += 0.1
        return served

    gap_only, bounded = run(None), run(1.0)
    assert gap_only[0] >= 1.5 and len(gap_only) <= 2
    assert 0.8 <= bounded[0] <= 1.1 and len(bounded) > 2 * len(gap_only)
