"""No tenant starved of the resident slots (scheduler/policies/shares.py): a tenant holding none
starts in place of a request of the tenant furthest over its weighted share, never the other way."""
from __future__ import annotations

import pytest

from sched_helpers import build, stats, step
from scheduler.policies import make_policy
from scheduler.policies.shares import ResidentShares

NO_AGING = dict(aging_bound_s=None)
LONG = dict(predicted=2000, max_tokens=4096)
BEST = dict(predicted=1, max_tokens=4096)       # b's requests have the best key in every policy


def _hog(n: int, **kw):
    """n started requests of tenant "a" (each served once, a at t = 0.1 · k)."""
    return [stats(f"a{k}", tenant="a", arrival=k * 0.01, taus=(2,), **LONG, **kw) for k in range(n)]


@pytest.mark.parametrize("name", ["fcfs", "sjf", "las", "laps"])
def test_a_tenant_under_its_share_starts_in_place_of_the_one_holding_every_slot(name):
    policy = make_policy(name, max_batch=2, max_resident=4, **NO_AGING)
    state = build(policy, _hog(4))
    for t in range(3):                                  # a's four hold every slot and run
        step(policy, state, t * 0.1)
    policy.add(state, stats("b0", tenant="b", arrival=-1, **BEST))
    plan = policy.plan(state, 1.0)
    assert "b0" in plan.request_ids
    assert len(plan.evict) == 1 and plan.evict[0].startswith("a")
    assert plan.evict[0] not in plan.request_ids        # never one of the step's own batch


def test_the_displaced_request_is_the_least_recently_served_of_the_tenant_over_its_share():
    policy = make_policy("fcfs", max_batch=2, max_resident=4, **NO_AGING)
    state = build(policy, _hog(4))
    for rid, served in zip(["a0", "a1", "a2", "a3"], [5.0, 1.0, 7.0, 6.0]):
        state.requests[rid].last_served_s = served
    policy.add(state, stats("b0", tenant="b", arrival=-1, **BEST))
    plan = policy.plan(state, 10.0)
    assert "b0" in plan.request_ids
    out = plan.evict[0]
    assert out == min((r for r in ("a0", "a1", "a2", "a3") if r not in plan.request_ids),
                      key=lambda r: state.requests[r].last_served_s)


def test_a_tenant_displaces_only_while_it_holds_none_and_the_displaced_cannot_displace_back():
    policy = make_policy("fcfs", max_batch=2, max_resident=4, **NO_AGING)
    state = build(policy, _hog(4))
    for k in range(4):
        policy.add(state, stats(f"b{k}", tenant="b", arrival=-1 + k * 0.01, **BEST))
    evicted = []
    for t in range(40):
        plan = step(policy, state, 1.0 + t * 0.1)
        evicted += plan.evict
    held = {t: sum(1 for r in policy._started if state.requests[r].tenant == t) for t in "ab"}
    assert held == {"a": 3, "b": 1}                     # b progresses; ordinary counts stay put
    assert evicted == ["a0"]                            # one displacement, never back


def test_the_tenant_furthest_over_its_weighted_share_gives_up_the_slot():
    # a holds 2 of 4 with weight 1 (share 1), c holds 2 with weight 3 (share 3): a is over
    policy = make_policy("fcfs", max_batch=4, max_resident=4, tenant_weights={"c": 3.0}, **NO_AGING)
    state = build(policy, _hog(2) + [stats(f"c{k}", tenant="c", arrival=k * 0.01, taus=(2,), **LONG)
                                     for k in range(2)])
    policy.add(state, stats("b0", tenant="b", arrival=-1, **BEST))
    plan = policy.plan(state, 1.0)
    assert "b0" in plan.request_ids and len(plan.evict) == 1 and plan.evict[0].startswith("a")


def test_share_is_the_weighted_part_of_the_cap_among_live_tenants():
    requests = {s.request_id: s for s in _hog(3)}
    shares = ResidentShares(requests, set(requests), 6, {"a": 1.0, "b": 2.0}.get,
                            lambda: {"a", "b"})
    assert shares.share("a") == 2 and shares.share("b") == 4
    b = stats("b0", tenant="b")
    out = shares.displaceable(b, taken={"a0"})
    assert out in {"a1", "a2"}                          # a holds 3 > 2; a0 is in the step
    a_new = stats("a9", tenant="a")
    assert shares.displaceable(a_new, taken=()) is None  # a holds some already
    shares.displace(out, b)
    assert shares.displaceable(stats("b1", tenant="b"), taken=()) is None   # b holds one now


def _tiered(s, tier):
    s.tier = tier
    return s


@pytest.mark.parametrize("name", ["fcfs", "laps", "priority"])
def test_a_priority_request_starts_in_place_of_a_lower_tiers_even_of_its_own_tenant(name):
    # without this, a started house of flex requests holds the priority tier's request until
    # one of them ends: its tier is served first, but only once it can start
    policy = make_policy(name, max_batch=2, max_resident=4, **NO_AGING)
    state = build(policy, [_tiered(s, "flex") for s in _hog(4)])
    for t in range(3):
        step(policy, state, t * 0.1)
    policy.add(state, _tiered(stats("p0", tenant="a", arrival=1.0, **LONG), "priority"))
    plan = policy.plan(state, 1.0)
    assert "p0" in plan.request_ids
    assert len(plan.evict) == 1 and plan.evict[0].startswith("a")
    assert plan.evict[0] not in plan.request_ids


def test_a_lower_tier_never_starts_in_place_of_a_higher_tiers_request():
    policy = make_policy("fcfs", max_batch=2, max_resident=4, **NO_AGING)
    state = build(policy, [_tiered(s, "default") for s in _hog(4)])
    for t in range(3):
        step(policy, state, t * 0.1)
    policy.add(state, _tiered(stats("f0", tenant="a", arrival=-1, **BEST), "flex"))
    plan = policy.plan(state, 1.0)
    assert "f0" not in plan.request_ids and not plan.evict
