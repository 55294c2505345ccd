"""Speculation backoff: poor acceptance reaches zero, zero probes, good text recovers, good text stays."""

import doctest

import pytest

import workers.speculation as speculation
from workers.drafters.base import NO_SPECULATION, TreeBudget
from workers.speculation import SpeculationConfig, SpeculationState, next_budget, record, step_cost

BASE = TreeBudget(16, 6)


def run(state, steps, accept):
    """Drive the controller for ``steps`` steps; ``accept(budget)`` -> (drafted, accepted).
    Returns the final state and the budgets handed out."""
    budgets = []
    for _ in range(steps):
        budget = next_budget(state, BASE)
        budgets.append(budget)
        drafted, accepted = accept(budget)
        state = record(state, drafted, accepted)
    return state, budgets


def full_tree(accepted_fraction_of_depth):
    """A drafter that always fills the budget and gets a fixed share of the depth accepted."""

    def accept(budget):
        return budget.max_nodes, int(budget.max_depth * accepted_fraction_of_depth)

    return accept


def test_doctests():
    assert doctest.testmod(speculation).failed == 0


def test_step_cost_table():
    assert step_cost(0) == 1.0 and step_cost(16) == 2.0 and step_cost(64) == 3.5
    assert step_cost(1) < step_cost(4) < step_cost(8) < step_cost(16) < step_cost(100)
    assert step_cost(3, ((0, 1.0), (10, 2.0))) == pytest.approx(1.3)


def test_high_acceptance_keeps_base():
    state, budgets = run(SpeculationState(), 50, full_tree(0.8))
    assert all(b == BASE for b in budgets)
    assert state.cap is None


def test_no_acceptance_goes_straight_to_zero():
    state, budgets = run(SpeculationState(), 4, lambda b: (b.max_nodes, 0))
    assert budgets == [BASE] * 4 and state.cap == 0
    assert next_budget(state, BASE) == NO_SPECULATION


def test_poor_acceptance_shrinks_step_by_step_to_zero():
    # 1 token accepted now and then: a 16-node tree (cost 2.0) needs > 1 accepted per step to pay.
    steps = iter(range(10_000))

    def poor(budget):
        return budget.max_nodes, 1 if next(steps) % 3 == 0 and budget.max_nodes > 0 else 0

    state, budgets = run(SpeculationState(), 60, poor)
    sizes = [b.max_nodes for b in budgets]
    assert sizes[:12] == [16] * 4 + [8] * 4 + [4] * 4  # halves after each window
    first_zero = sizes.index(0)
    assert first_zero < 25 and sizes[:first_zero] == sorted(sizes[:first_zero], reverse=True)
    # Afterwards only small probes, which fail and go back to zero.
    assert set(sizes[first_zero:]) == {0, 2} and state.cap == 0 and state.failed_probes >= 2
    assert all(b.max_depth <= b.max_nodes for b in budgets)  # depth never exceeds the node count


def test_zero_probes_with_growing_waits():
    state = SpeculationState(cap=0)
    probes = []
    for i in range(600):
        budget = next_budget(state, BASE)
        if budget.speculates:
            probes.append(i)
            assert budget == TreeBudget(2, 2)  # a small probe, not the base
        state = record(state, budget.max_nodes, 0)  # the probe accepts nothing
    # A probe lasts one window (4 steps); each failed one doubles the wait before the next: 8, 16, 32...
    starts = [i for i in probes if i - 1 not in probes]
    assert starts == [8, 28, 64, 132, 264, 524]
    assert all(set(range(s, s + 4)) <= set(probes) and s + 4 not in probes for s in starts)
    assert state.failed_probes == len(starts)


def test_probe_wait_is_capped():
    cfg = SpeculationConfig(probe_after=4, probe_growth=10, max_probe_after=50)
    assert SpeculationState(cfg, cap=0, failed_probes=5).probe_wait == 50


def test_recovers_when_text_becomes_predictable():
    state, _ = run(SpeculationState(), 8, lambda b: (b.max_nodes, 0))
    assert state.cap == 0
    # Now the drafter nails every token: a probe succeeds and the cap doubles back to the base.
    state, budgets = run(state, 80, full_tree(1.0))
    assert budgets[-1] == BASE
    assert state.failed_probes == 0
    sizes = [b.max_nodes for b in budgets if b.speculates]
    assert sizes[0] == 2 and 4 in sizes and 8 in sizes


def test_empty_drafts_are_not_rejections():
    # The drafter found nothing (0 drafted) for a long time: no shrinking, and still the base.
    state, budgets = run(SpeculationState(), 40, lambda b: (0, 0))
    assert state == SpeculationState() and all(b == BASE for b in budgets)
    # Interleaved with good steps, empty drafts do not dilute the evidence either.
    steps = iter(range(10_000))
    state, budgets = run(SpeculationState(), 40, lambda b: (b.max_nodes, 4) if next(steps) % 2 else (0, 0))
    assert all(b == BASE for b in budgets)


def test_empty_probe_keeps_offering_the_probe():
    state = SpeculationState(cap=0, idle_steps=8)
    assert next_budget(state, BASE).speculates
    state = record(state, 0, 0)  # the drafter had nothing this time
    assert next_budget(state, BASE).speculates and state.cap == 0


def test_small_drafts_are_judged_by_their_own_cost():
    # A 2-node chain accepting one token half of the time: speedup 1.5 / 1.47 ≈ 1.02: worth keeping,
    # even though the same acceptance would not pay for a 16-node tree.
    steps = iter(range(10_000))
    state, budgets = run(SpeculationState(), 40, lambda b: (2, next(steps) % 2))
    assert all(b == BASE for b in budgets)


def test_cap_follows_a_smaller_base_and_never_exceeds_it():
    state = SpeculationState(cap=8)
    assert next_budget(state, TreeBudget(4, 3)) == TreeBudget(4, 3)
    assert next_budget(state, TreeBudget(16, 6)) == TreeBudget(8, 6)
    assert next_budget(SpeculationState(), NO_SPECULATION) == NO_SPECULATION
    assert next_budget(SpeculationState(cap=0, idle_steps=100), NO_SPECULATION) == NO_SPECULATION


def test_grows_only_while_the_cap_binds():
    # The drafter never drafts more than 3 nodes: a cap of 4 is not the limit, so it does not grow.
    state, _ = run(SpeculationState(cap=4), 20, lambda b: (min(3, b.max_nodes), min(3, b.max_nodes)))
    assert state.cap == 4


def test_record_is_pure_and_validates():
    state = SpeculationState()
    after = record(state, 16, 3)
    assert state.recent == () and after.recent == ((16, 3),)
    for drafted, accepted in ((-1, 0), (3, 4), (3, -1)):
        with pytest.raises(ValueError):
            record(state, drafted, accepted)


@pytest.mark.parametrize(
    "kwargs",
    [dict(window=0), dict(probe_after=-1), dict(probe_after=10, max_probe_after=5), dict(probe_growth=0.5),
     dict(probe_nodes=0), dict(step_cost=((1, 1.0), (2, 2.0))), dict(step_cost=((0, 1.0),))],
)
def test_config_validated(kwargs):
    with pytest.raises(ValueError):
        SpeculationConfig(**kwargs)
