"""Tenants' row shares of a step (scheduler/policies/row_shares.py): in a step shared by several
tenants, one tenant's draft nodes and prefill chunks take at most its share of the rows beyond
one a request, so that another tenant's gaps (the step's duration) stay short."""
from __future__ import annotations

import pytest

from sched_helpers import build, stats
from scheduler.alpha import AlphaEstimate
from scheduler.policies import make_policy
from scheduler.profile import StepCostModel

COST = StepCostModel.from_json(None)
BUDGET, BATCH = 64, 9
SPARE = BUDGET - BATCH            # rows beyond one a request, in a full batch


def _planner(share, **cfg):
    return make_policy("fcfs", max_batch=BATCH, token_budget=BUDGET, aging_bound_s=None,
                       step_cost=COST, tenant_row_share=share, **cfg)


def _mix(*, tenants=("attacker", "victim"), prompt: int = 10) -> list:
    """Eight requests of the first tenant whose drafts are almost always accepted (a repetitive
    stream), and one of the other whose drafts almost never are."""
    out = []
    for i in range(8):
        s = stats(f"a{i}", tenant=tenants[0], arrival=i * 0.01)
        s.estimate = AlphaEstimate(accepted=60.0, rejected=1.0)
        s.prompt_len = prompt
        out.append(s)
    v = stats("v", tenant=tenants[1], arrival=0.5)
    v.estimate = AlphaEstimate(accepted=1.0, rejected=20.0)
    out.append(v)
    return out


def _rows(plan, state, tenant: str) -> int:
    """Rows beyond one a request that `tenant`'s requests take in `plan`: nodes and chunks."""
    chunks = plan.prefill or [0] * len(plan)
    return sum(b.max_nodes + max(c - 1, 0) for rid, b, c in zip(plan.request_ids, plan.budgets, chunks)
               if state.requests[rid].tenant == tenant)


def test_a_tenant_whose_drafts_are_accepted_takes_at_most_half_a_shared_step():
    free = _planner(None)
    state = build(free, _mix())
    unshared = free.plan(state, 1.0)
    assert _rows(unshared, state, "attacker") > SPARE // 2      # what the shares are for

    shared = _planner(0.5)
    state = build(shared, _mix())
    plan = shared.plan(state, 1.0)
    assert len(plan) == BATCH
    assert 0 < _rows(plan, state, "attacker") <= SPARE // 2
    # the step every request waits for is shorter: what the victim's gap between tokens is
    assert COST(len(plan), plan.tokens) < COST(len(unshared), unshared.tokens)


def test_a_step_of_one_tenant_is_not_limited():
    one = ("solo", "solo")
    free, shared = _planner(None), _planner(0.5)
    a, b = build(free, _mix(tenants=one)), build(shared, _mix(tenants=one))
    p, q = free.plan(a, 1.0), shared.plan(b, 1.0)
    assert [x.max_nodes for x in p.budgets] == [x.max_nodes for x in q.budgets]
    assert _rows(q, b, "solo") > SPARE // 2


def test_a_heavier_tenant_keeps_its_weights_share():
    planner = _planner(0.5, tenant_weights={"attacker": 3.0, "victim": 1.0})
    state = build(planner, _mix())
    rows = _rows(planner.plan(state, 1.0), state, "attacker")
    assert SPARE // 2 < rows <= int(SPARE * 0.75)


@pytest.mark.parametrize("share", [0.5, None])
def test_a_prompt_flood_takes_at_most_its_share_of_a_step_beside_another_tenants_stream(share):
    """Chunked prefill: eight long prompts of one tenant beside another tenant's decoding stream
    (the victim holds its KV); their chunks and nodes count against their share together."""
    planner = _planner(share, prefill_chunk_tokens=24)
    reqs = _mix(prompt=500)
    reqs[-1].prefill_left, reqs[-1].kv_tokens = 0, 12       # the victim decodes
    state = build(planner, reqs)
    plan = planner.plan(state, 1.0)
    assert "v" in plan.request_ids
    rows = _rows(plan, state, "attacker")
    if share is None:
        assert rows > SPARE // 2                 # unshared, the flood's chunks fill the step
    else:
        assert 0 < rows <= SPARE // 2            # still advancing, within its half


def test_shares_need_a_share_in_range():
    with pytest.raises(ValueError, match="tenant_row_share"):
        _planner(1.5)


def test_rows_are_held_back_only_for_streams_of_the_same_tier_or_above():
    """A `priority` tenant's rows are not capped for a `default` stream beside it; the `default`
    tenant's rows are, for the `priority` streams (the tiers sell the first no right to slow)."""
    planner = _planner(0.5)
    reqs = _mix()
    for s in reqs[:8]:
        s.tier = "priority"                         # the repetitive streams are sold priority
    state = build(planner, reqs)
    assert _rows(planner.plan(state, 1.0), state, "attacker") > SPARE // 2

    planner = _planner(0.5)
    reqs = _mix(tenants=("bulk", "urgent"))
    reqs[-1].tier = "priority"                      # one priority stream beside a default flood
    state = build(planner, reqs)
    assert 0 < _rows(planner.plan(state, 1.0), state, "bulk") <= SPARE // 2


def test_a_step_in_which_nobody_decodes_holds_nothing_back():
    """Only streams' gaps are at stake: two tenants' prompts prefilling side by side, nobody
    decoding, are chunked as they would be without shares."""
    plans = []
    for share in (0.5, None):
        planner = _planner(share, prefill_chunk_tokens=24)
        reqs = _mix(prompt=500)
        reqs[-1].prompt_len = 500                 # the other tenant waits for its context too
        state = build(planner, reqs)
        plan = planner.plan(state, 1.0)
        plans.append((plan.request_ids, plan.prefill, [b.max_nodes for b in plan.budgets]))
    assert plans[0] == plans[1]
    assert sum(plans[0][1]) > BUDGET              # an idle step prefills past the row budget
