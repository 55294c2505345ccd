"""Service tiers in the planner, on hand-made states: priority is planned ahead of default and
flex and never preempted by them, flex gets what is left yet never waits past its maximum wait,
tenants share fairly inside a tier, and the strict `priority` policy is the baseline."""
import pytest

from sched_helpers import build, stats, step
from scheduler.policies import POLICIES, Priority, make_policy
from scheduler.request import StepRecord
from scheduler.tiers import TIERS, plan_class

NO_AGING = dict(aging_bound_s=None)
SRPT = {"oracle": lambda s: 100}


def tiered(rid, tier, **kw):
    s = stats(rid, **kw)
    s.tier = tier
    return s


def policy(name, **kw):
    return make_policy(name, **({**SRPT, **kw} if name == "srpt" else kw))


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_priority_is_planned_ahead_of_default_and_flex_whatever_they_look_like(name):
    """Earlier arrivals, shorter predictions and less attained service in lower tiers do not
    put them ahead: batch 2 of 4 takes the two priority requests, the latest to arrive."""
    reqs = [tiered("flex", "flex", arrival=0, predicted=1),
            tiered("default", "default", arrival=1, predicted=2),
            tiered("p_late", "priority", arrival=9, predicted=900, attained=500, taus=(1, 1)),
            tiered("p", "priority", arrival=8, predicted=800)]
    p = policy(name, max_batch=2, **NO_AGING)
    assert sorted(p.plan(build(p, reqs), 100.0).request_ids) == ["p", "p_late"]


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_flex_is_planned_only_with_what_is_left(name):
    reqs = [tiered("f", "flex", arrival=0, predicted=1), tiered("d", "default", arrival=5),
            tiered("p", "priority", arrival=6), tiered("d2", "default", arrival=7)]
    for batch, expected in ((3, ["p", "d", "d2"]), (4, None)):
        p = policy(name, max_batch=batch, **NO_AGING)
        got = p.plan(build(p, reqs), 100.0).request_ids
        if expected is None:                    # room for everyone: flex runs too
            assert set(got) == {"f", "d", "p", "d2"}
        else:
            assert got[0] == "p" and set(got) == set(expected)


def test_a_tier_comes_before_the_tenant_class():
    """A priority request of a low-class tenant goes ahead of a default request of the most
    urgent class; within a tier the tenants' classes keep their order."""
    reqs = [tiered("d_c0", "default", priority=0, arrival=0),
            tiered("p_c5", "priority", priority=5, arrival=3),
            tiered("p_c1", "priority", priority=1, arrival=4)]
    p = make_policy("fcfs", max_batch=2, **NO_AGING)
    assert p.plan(build(p, reqs), 10.0).request_ids == ["p_c1", "p_c5"]
    assert plan_class("default", 3) == 3       # default: the tenant's class as before tiers


@pytest.mark.parametrize("name", ["fcfs", "laps", "priority"])
def test_priority_is_never_preempted_by_lower_tiers_even_overdue_ones(name):
    """A default and a flex request far past every aging bound, a running priority request in
    a batch of one: the priority request keeps its slot, step after step."""
    p = policy(name, max_batch=1, aging_bound_s=1.0, tier_wait_s={"flex": 1.0})
    reqs = [tiered("d", "default", arrival=0), tiered("f", "flex", arrival=0),
            tiered("pr", "priority", arrival=50)]
    state = build(p, reqs)
    now = 100.0
    for _ in range(20):
        assert step(p, state, now).request_ids == ["pr"]
        now += 0.1


def test_aged_default_requests_do_not_displace_a_full_batch_of_priority():
    p = make_policy("laps", max_batch=2, aging_bound_s=0.5)
    reqs = [tiered("d", "default", arrival=0), tiered("p1", "priority", arrival=10),
            tiered("p2", "priority", arrival=11)]
    state = build(p, reqs)
    plans = [set(step(p, state, 20.0 + 0.1 * i).request_ids) for i in range(10)]
    assert all(plan == {"p1", "p2"} for plan in plans)


def test_flex_never_waits_past_its_max_wait_while_default_keeps_the_batch_full():
    """Ten default requests keep a batch of two busy (none finishes); a flex request is left
    out until its wait nears flex's bound, then served ahead of default's queue, and no gap
    of its own ever passes the bound."""
    wait = 1.0
    p = make_policy("laps", max_batch=2, aging_bound_s=None, tier_wait_s={"flex": wait})
    reqs = [tiered(f"d{i}", "default", arrival=0) for i in range(10)] + [tiered("f", "flex", arrival=0)]
    state = build(p, reqs)
    flex = state.requests["f"]
    now, first = 0.0, None
    for i in range(100):
        if "f" in step(p, state, now).request_ids and first is None:
            first = now
        now += 0.1
    assert first is not None and 0.5 <= first <= wait       # put off, never past its wait
    assert flex.n_steps >= 5 and flex.max_wait_s <= wait + 1e-9


def test_without_a_max_wait_flex_starves_behind_a_full_default_tier():
    """The test above fails without tier aging: the same load with flex unbounded."""
    p = make_policy("laps", max_batch=2, aging_bound_s=None)
    reqs = [tiered(f"d{i}", "default", arrival=0) for i in range(10)] + [tiered("f", "flex", arrival=0)]
    state = build(p, reqs)
    for i in range(100):
        assert "f" not in step(p, state, 0.1 * i).request_ids


def test_the_strict_priority_policy_never_promotes_flex():
    p = make_policy("priority", max_batch=2, aging_bound_s=1.0, tier_wait_s={"flex": 1.0})
    reqs = [tiered(f"d{i}", "default", arrival=0) for i in range(4)] + [tiered("f", "flex", arrival=0)]
    state = build(p, reqs)
    for i in range(100):
        assert "f" not in step(p, state, 0.1 * i).request_ids


def test_the_priority_policy_is_fcfs_inside_a_tier_with_no_prediction():
    assert isinstance(make_policy("priority").ordering, Priority)
    p = make_policy("priority", max_batch=3, **NO_AGING)
    reqs = [tiered("d_late_short", "default", arrival=5, predicted=1),
            tiered("d_early_long", "default", arrival=1, predicted=5000),
            tiered("p_late", "priority", arrival=9), tiered("d_mid", "default", arrival=3),
            tiered("f_first", "flex", arrival=0)]
    assert p.plan(build(p, reqs), 10.0).request_ids == ["p_late", "d_early_long", "d_mid"]


def test_tenants_share_fairly_inside_a_tier():
    """Two tenants in the default tier, one flooding: the other still gets its share of a
    full batch (weighted fair sharing, as before tiers); a priority request comes first."""
    p = make_policy("fcfs", max_batch=2, fair_lag_tokens=0.0, **NO_AGING)
    reqs = ([tiered(f"a{i}", "default", tenant="a", arrival=i * 0.01) for i in range(8)]
            + [tiered(f"b{i}", "default", tenant="b", arrival=1 + i * 0.01) for i in range(2)])
    state = build(p, reqs)
    served = {"a": 0, "b": 0}
    for i in range(20):
        for rid in step(p, state, 10.0 + 0.1 * i).request_ids:
            served[rid[0]] += 1
    assert served["b"] >= 0.4 * sum(served.values())
    p.add(state, tiered("pr", "priority", tenant="a", arrival=50))
    assert step(p, state, 20.0).request_ids[0] == "pr"


def test_fairness_accounts_are_kept_per_tier():
    """A tenant's work in one tier is charged to that tier's account only, so heavy flex use
    does not cost it its share of default."""
    p = make_policy("fcfs", max_batch=1, **NO_AGING)
    state = build(p, [tiered("f", "flex", tenant="a"), tiered("d", "default", tenant="b")])
    p.update(state, [StepRecord("f", 5, 1)], 1.0, 0.1)
    assert state.virtual_time[(plan_class("flex", 0), "a")] == 5.0
    assert state.virtual_time.get((0, "a"), 0.0) == 0.0


def test_a_start_that_only_one_kv_budget_fits_goes_to_the_highest_tier():
    """Everyone fits the batch, only one start fits the KV budget: the priority request gets
    it, though it arrived last."""
    p = make_policy("fcfs", max_batch=4, kv_budget_tokens=400, kv_block=256, kv_tree_tokens=65)
    reqs = [tiered("f", "flex", arrival=0), tiered("d", "default", arrival=1),
            tiered("p", "priority", arrival=2)]
    assert p.plan(build(p, reqs), 10.0).request_ids == ["p"]


def test_a_request_of_an_unknown_tier_is_planned_as_default():
    p = make_policy("fcfs", max_batch=1, **NO_AGING)
    reqs = [tiered("x", "scale", arrival=0), tiered("f", "flex", arrival=-1)]
    assert p.plan(build(p, reqs), 10.0).request_ids == ["x"]


def test_tier_waits_are_checked():
    with pytest.raises(ValueError, match="unknown tier"):
        make_policy("fcfs", tier_wait_s={"gold": 1.0})
    with pytest.raises(ValueError, match="> 0"):
        make_policy("fcfs", tier_wait_s={"flex": 0})
    assert TIERS == ("priority", "default", "flex")


def test_a_tiers_fairness_account_survives_the_stores_codec():
    from scheduler.store.base import account_from_str, account_to_str

    for tier in TIERS:
        account = (plan_class(tier, 3), "acme:eu")
        assert account_from_str(account_to_str(account)) == account


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_tier_emptied_before_a_queued_one_is_skipped_not_fatal(name):
    """A class whose last request ended stays out of the plan: the planner once kept it, with no
    tenant to be fair between, and failed the step loop planning the flex queue behind it."""
    from scheduler.request import Status

    p = policy(name, max_batch=1)
    state = build(p, [tiered("d", "default")])
    p.remove(state, "d", Status.CANCELLED, None, 1.0)
    for rid in ("f1", "f2"):
        p.add(state, tiered(rid, "flex", tenant=rid, arrival=2.0))
    assert p.plan(state, 3.0).request_ids in (["f1"], ["f2"])


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_tier_whose_requests_all_left_is_skipped(name):
    """The priority tier's only request finishes while more default requests are live than a
    batch holds: the plan chooses among them (the emptied class once made the fair-share merge
    take the minimum of no tenants, and the step loop's plan raised)."""
    reqs = [tiered("p", "priority", arrival=0, predicted=1)] + [
        tiered(f"d{i}", "default", arrival=1 + i, tenant=f"t{i % 2}") for i in range(4)]
    p = policy(name, max_batch=2, **NO_AGING)
    state = build(p, reqs)
    step(p, state, 10.0, finish={"p"})
    assert "p" not in state.requests
    assert len(p.plan(state, 11.0).request_ids) == 2
