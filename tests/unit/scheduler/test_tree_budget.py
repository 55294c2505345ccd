import pytest

from scheduler.budget import TreeBudget, TreeBudgeter, expected_tau, goodput_threshold, tree_budgets
from scheduler.profile import StepCostModel


@pytest.mark.parametrize("alpha, depth, tau", [
    (0.0, 5, 1.0), (0.5, 0, 1.0), (0.5, 1, 1.5), (0.5, 3, 1.875), (1.0, 4, 5.0)])
def test_expected_tau(alpha, depth, tau):
    assert expected_tau(alpha, depth) == pytest.approx(tau)


@pytest.mark.parametrize("alphas, spare, kw, nodes", [
    ([0.8, 0.5, 0.05], 100, dict(min_gain=0.2), [7, 2, 0]),    # α^k ≥ 0.2
    ([0.9, 0.9], 100, dict(max_nodes=3), [3, 3]),               # per-request cap
    ([0.9, 0.9, 0.9, 0.9], 6, {}, None),                        # spare shared out: Σ = 6
    ([0.99], 2, {}, [2]),
    ([0.5, 0.6], 0, {}, [0, 0]),                                # no spare tokens, no drafts
    ([], 10, {}, []),
])
def test_tree_budgets(alphas, spare, kw, nodes):
    got = tree_budgets(alphas, spare, **kw)
    assert sum(b.max_nodes for b in got) <= spare
    assert all(b.max_depth <= b.max_nodes for b in got)
    if nodes is None:
        assert sum(b.max_nodes for b in got) == spare
    else:
        assert [b.max_nodes for b in got] == nodes


def test_max_depth_caps_depth_not_nodes():
    assert tree_budgets([0.95], 20, max_nodes=10, max_depth=4) == [TreeBudget(10, 4)]


def test_costly_tokens_mean_smaller_trees():
    flat = lambda b, n: 0.05                            # drafting is free: every useful node
    steep = lambda b, n: 0.04 + 0.01 * n                # each token costs a quarter of a step
    alphas = [0.7] * 4
    free = sum(b.max_nodes for b in tree_budgets(alphas, 60, step_cost=flat, min_gain=0.01))
    dear = sum(b.max_nodes for b in tree_budgets(alphas, 60, step_cost=steep, min_gain=0.01))
    assert dear < free
    assert goodput_threshold(alphas, steep, cap=8) > goodput_threshold(alphas, flat, cap=8)


def test_budgeter_matches_exact_budgets_on_a_homogeneous_batch():
    cost = StepCostModel.from_json()
    budgeter = TreeBudgeter(cost)
    for n in (1, 4, 8):
        alphas = [0.6] * n
        assert budgeter(alphas, 64 - n) == tree_budgets(alphas, 64 - n, step_cost=cost)
