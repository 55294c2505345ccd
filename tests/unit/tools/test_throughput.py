"""The throughput model (tools/throughput.py): τ and node counts per tree shape, step cost,
the SPIRe multiplier, budget choice down to zero, and the fits from acceptance history. Pure
arithmetic: hand-written cases and seeded simulations, no model, no timing."""
import random

import pytest

from scheduler.profile import StepCostModel
from tools.throughput import (Acceptance, DrafterCost, ThroughputModel, TreeShape,
                                  fit_acceptance, fit_drafter_cost)
from workers.contract import NO_SPECULATION, TreeBudget
from scheduler.sizing import expected_tau


def linear(base=0.04, per_token=0.001):
    return lambda batch, tokens, context=None: base + per_token * tokens


@pytest.mark.parametrize("text, widths, depth, nodes, budget", [
    ("none", (), 0, 0, NO_SPECULATION),
    ("chain:0", (), 0, 0, NO_SPECULATION),
    ("chain:1", (1,), 1, 1, TreeBudget(1, 1)),
    ("chain:8", (1,) * 8, 8, 8, TreeBudget(8, 8)),
    ("widths:2x2x1", (2, 2, 1), 3, 10, TreeBudget(10, 3)),    # 2 + 4 + 4
    ("widths:3x1", (3, 1), 2, 6, TreeBudget(6, 2)),
])
def test_tree_shapes(text, widths, depth, nodes, budget):
    shape = TreeShape.parse(text)
    assert (shape.widths, shape.depth, shape.nodes, shape.budget()) == (widths, depth, nodes, budget)
    assert TreeShape.parse(shape.name) == shape


@pytest.mark.parametrize("text", ["chain", "chain:x", "widths:", "widths:2x0", "tree:3", "none:1"])
def test_bad_tree_shapes(text):
    with pytest.raises(ValueError):
        TreeShape.parse(text)


@pytest.mark.parametrize("acc, shape, tau, nodes", [
    (Acceptance(0.5), "none", 1.0, 0.0),
    (Acceptance(0.5), "chain:2", 1.75, 2.0),
    (Acceptance(1.0), "chain:4", 5.0, 4.0),
    (Acceptance(0.0), "chain:8", 1.0, 8.0),                       # drafted, never accepted
    (Acceptance(0.5, coverage=0.5), "chain:2", 1.375, 1.0),       # half the steps plain
    (Acceptance(0.5, reach=0.5), "chain:3", 1.65625, 1.75),       # 1 + .5 + .125 + .03125
    (Acceptance(0.5), "widths:2", 1.75, 2.0),                     # β2 = 1 − .5²
    (Acceptance(0.5), "widths:2x1", 2.125, 4.0),                  # 1 + .75 + .375
    (Acceptance(0.6, coverage=0.8, reach=0.9), "widths:1x1x1",    # widths of 1: the chain formula
     1 + 0.8 * (0.6 + 0.9 * 0.36 + 0.81 * 0.216), 0.8 * (1 + 0.9 + 0.81)),
])
def test_expected_tau_and_nodes(acc, shape, tau, nodes):
    shape = TreeShape.parse(shape)
    assert acc.tau(shape) == pytest.approx(tau)
    assert acc.nodes(shape) == pytest.approx(nodes)


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.7, 0.95, 1.0])
@pytest.mark.parametrize("depth", [1, 4, 8])
def test_the_chain_case_is_the_speculation_chain_model(alpha, depth):
    assert Acceptance(alpha).tau(TreeShape.chain(depth)) == pytest.approx(expected_tau(alpha, depth))


@pytest.mark.parametrize("acc, widths", [
    (Acceptance(0.7, coverage=0.6, reach=0.8), (1, 1, 1, 1, 1)),
    (Acceptance(0.4), (3, 2, 1)),
    (Acceptance(0.55, coverage=0.9, reach=0.7), (2, 1, 1)),
])
def test_tau_matches_a_simulation_of_the_acceptance_model(acc, widths):
    """Simulate the model's own story: propose (q), each level exists (ρ), the i-th sibling is
    right with probability α(1 − α)^(i−1); the formula must match the long-run mean."""
    rng = random.Random(7)
    total, trials = 0, 40_000
    for _ in range(trials):
        tau = 1
        if rng.random() < acc.coverage:
            for level, k in enumerate(widths):
                if level and rng.random() >= acc.reach:
                    break
                if not any(rng.random() < acc.alpha for _ in range(k)):
                    break
                tau += 1
        total += tau
    assert total / trials == pytest.approx(acc.tau(TreeShape(widths)), rel=0.01)


def test_plain_decoding_is_multiplier_one_and_costs_the_zero_node_step():
    m = ThroughputModel(linear())
    for batch in (1, 4, 32):
        p = m.predict(Acceptance(0.9), TreeShape(), batch, drafter=DrafterCost(fixed_s=1.0))
        assert (p.tau, p.nodes, p.draft_s, p.multiplier) == (1.0, 0.0, 0.0, 1.0)
        assert p.step_s == p.plain_step_s == pytest.approx(0.04 + 0.001 * batch)
        assert p.tokens_per_s == pytest.approx(batch / (0.04 + 0.001 * batch))


@pytest.mark.parametrize("depth, t_draft, t_target, t_verify", [
    (4, 0.002, 0.041, 0.045),       # a model drafter: one forward of t_draft per level
    (8, 0.005, 0.041, 0.049),
    (1, 0.0, 0.041, 0.042),         # a free drafter
])
def test_the_multiplier_is_spires_formula(depth, t_draft, t_target, t_verify):
    acc = Acceptance(0.7)
    p = ThroughputModel(linear()).predict(acc, TreeShape.chain(depth), 1,
                                          drafter=DrafterCost(per_level_s=t_draft))
    assert (p.plain_step_s, p.step_s) == pytest.approx((t_target, t_verify))
    tau = expected_tau(0.7, depth)
    assert p.multiplier == pytest.approx(tau / ((depth * t_draft + t_verify) / t_target))
    assert p.tokens_per_s == pytest.approx(p.multiplier * p.plain_tokens_per_s)


def test_step_cost_is_the_expectation_over_how_many_requests_propose():
    convex = lambda batch, tokens, context=None: 0.01 * tokens ** 2
    m, shape, acc = ThroughputModel(convex), TreeShape.chain(4), Acceptance(0.5, coverage=0.5)
    # batch 2: 0, 1 or 2 requests propose 4 nodes: tokens 2, 6, 10 with probability 1/4, 1/2, 1/4
    assert m.verify_s(acc, shape, 2) == pytest.approx(0.01 * (4 / 4 + 36 / 2 + 100 / 4))
    lin = ThroughputModel(linear())                          # linear cost: the mean's cost
    assert lin.verify_s(acc, shape, 8) == pytest.approx(0.04 + 0.001 * (8 + 8 * 2))


def test_overhead_and_context_reach_the_step_cost():
    seen = []

    def cost(batch, tokens, context=None):
        seen.append(context)
        return 0.04

    p = ThroughputModel(cost, overhead_s=0.001).predict(Acceptance(0.5), TreeShape.chain(2), 4, 700)
    assert set(seen) == {700}
    assert p.plain_step_s == pytest.approx(0.044) and p.step_s == pytest.approx(0.044)


def test_longer_contexts_predict_slower_steps_from_a_profile_with_contexts():
    profile = StepCostModel([(1, [1, 9], [0.03, 0.04])], context=200,
                            contexts=[(1000, [(1, [1, 9], [0.04, 0.05])])])
    m = ThroughputModel(profile)
    short, long = (m.predict(Acceptance(0.6), TreeShape.chain(8), 1, c) for c in (200, 1000))
    assert long.tokens_per_s < short.tokens_per_s
    assert long.step_s == pytest.approx(0.05)


# ---- choosing the budget, down to zero --------------------------------------------------------
CHAINS = [TreeShape.chain(d) for d in (1, 2, 4, 8, 16)]


@pytest.mark.parametrize("alpha, cost, batch, chosen", [
    (0.85, linear(), 1, "chain:16"),                # cheap nodes, good drafts: deep
    (0.02, linear(), 1, "none"),                    # acceptance near zero
    (0.0, linear(0.04, 0.0), 1, "none"),            # even free nodes are worth nothing at α = 0
    (0.85, linear(0.0, 0.001), 16, "none"),         # compute-bound: a node costs a root row
    (0.85, linear(0.04, 0.01), 32, "none"),         # large batch, steep: 320 ms of rows already
])
def test_best_shape(alpha, cost, batch, chosen):
    assert ThroughputModel(cost).best_shape(Acceptance(alpha), CHAINS, batch).name == chosen


def test_an_expensive_drafter_is_not_worth_its_acceptance():
    m, acc = ThroughputModel(linear()), Acceptance(0.6)
    assert m.best_shape(acc, CHAINS, 1).name != "none"
    slow = DrafterCost(per_level_s=0.04)           # each draft level costs a target step
    assert m.best_shape(acc, CHAINS, 1, drafter=slow).name == "none"


# ---- fitting acceptance history ---------------------------------------------------------------
def simulate_history(acc: Acceptance, depth: int, steps: int, seed: int = 0):
    rng = random.Random(seed)
    out = []
    for _ in range(steps):
        if rng.random() >= acc.coverage:
            out.append((depth, 0, 0, 0))
            continue
        length = 1
        while length < depth and rng.random() < acc.reach:
            length += 1
        accepted = 0
        while accepted < length and rng.random() < acc.alpha:
            accepted += 1
        out.append((depth, length, length, accepted))
    return out


@pytest.mark.parametrize("truth", [
    Acceptance(0.8), Acceptance(0.3, coverage=0.5), Acceptance(0.9, coverage=0.7, reach=0.6),
    Acceptance(0.05, coverage=1.0, reach=0.9)])
def test_fit_acceptance_recovers_the_parameters(truth):
    got = fit_acceptance(simulate_history(truth, depth=8, steps=20_000))
    assert got.alpha == pytest.approx(truth.alpha, abs=0.02)
    assert got.coverage == pytest.approx(truth.coverage, abs=0.02)
    assert got.reach == pytest.approx(truth.reach, abs=0.02)


@pytest.mark.parametrize("history, fitted", [
    ([(4, 4, 4, 4)] * 3, Acceptance(1.0, 1.0, 1.0)),           # never rejected, always full
    ([(4, 0, 0, 0), (4, 1, 1, 0)], Acceptance(0.0, 0.5, 0.0)),  # one proposal, one node, rejected
    ([(0, 0, 0, 0), (2, 2, 2, 1)], Acceptance(0.5, 1.0, 1.0)),  # budget-0 steps are no evidence
])
def test_fit_acceptance_cases(history, fitted):
    assert fit_acceptance(history) == fitted


def test_fit_acceptance_needs_a_drafting_step():
    with pytest.raises(ValueError):
        fit_acceptance([(0, 0, 0, 0)])


@pytest.mark.parametrize("calls, fixed, per_node", [
    ([(0, 2e-4), (4, 4e-4), (8, 6e-4)], 2e-4, 5e-5),
    ([(3, 1e-4), (3, 3e-4)], 2e-4, 0.0),                        # no spread in nodes: the mean
    ([(0, 5e-4), (8, 1e-4)], 3e-4, 0.0),                        # a falling line: flat, the mean
    ([], 0.0, 0.0),
])
def test_fit_drafter_cost(calls, fixed, per_node):
    got = fit_drafter_cost(calls)
    assert (got.fixed_s, got.per_node_s) == pytest.approx((fixed, per_node))
