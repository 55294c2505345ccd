import pytest

from scheduler.admission import (ADMITTED, AdmissionControl, AdmissionLimits, Refused, decide)
from scheduler.policies import make_policy
from scheduler.profile import StepCostModel
from tools.sim import simulate
from tools.workload_gen import WorkloadSpec, generate, with_arrivals

LIMITS = AdmissionLimits(max_live=10, max_live_per_tenant=4, per_tenant={"vip": 8},
                         min_retry_after_s=1, max_retry_after_s=30)


@pytest.mark.parametrize("tenant, live, live_tenant, drain, expected", [
    ("a", 0, 0, None, ADMITTED),
    ("a", 9, 3, None, ADMITTED),
    ("a", 5, 4, 2.0, Refused("tenant_queue_full", 1.0)),       # 1 place ÷ 2/s → clamped to 1
    ("a", 5, 6, 0.1, Refused("tenant_queue_full", 30.0)),      # 3 places ÷ 0.1/s → capped at 30
    ("vip", 9, 6, None, ADMITTED),                              # per-tenant override
    ("vip", 10, 6, 0.5, Refused("queue_full", 2.0)),            # global bound
    ("b", 12, 0, None, Refused("queue_full", 30.0)),            # no drain rate known: the cap
])
def test_decide(tenant, live, live_tenant, drain, expected):
    assert decide(LIMITS, tenant, live, live_tenant, drain) == expected


def test_refusals_map_to_http_statuses():
    assert Refused("tenant_queue_full", 1).http_status == 429
    assert Refused("queue_full", 1).http_status == 503
    assert ADMITTED and Refused("queue_full", 1)     # both are truthy: test with `is ADMITTED`


def test_counts_follow_admit_and_release():
    ac = AdmissionControl(LIMITS)
    got = [ac.admit("a") for _ in range(5)]
    assert got[:4] == [ADMITTED] * 4 and isinstance(got[4], Refused)
    assert (ac.live, ac.live_by_tenant) == (4, {"a": 4})
    ac.release("a")
    assert ac.admit("a") is ADMITTED
    with pytest.raises(ValueError):
        ac.release("nobody")


def test_nothing_admitted_is_dropped():
    # a burst far beyond the limits: every admitted request finishes, the rest are refused
    reqs = with_arrivals(generate(WorkloadSpec(), 300, seed=5), rate=50.0, seed=6)
    limits = AdmissionLimits(max_live=20, max_live_per_tenant=8)
    out = simulate(make_policy("laps", aging_bound_s=None), reqs, StepCostModel.from_json(),
                   WorkloadSpec(), limits)
    assert out.refused > 0
    assert len(out.finished) + out.refused == len(reqs)
    assert len({s.request_id for s in out.finished}) == len(out.finished)
    assert all(s.finish_reason in ("stop", "length") for s in out.finished)
