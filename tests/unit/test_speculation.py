"""Speculation sizing: goodput-best depth from the cost curve and the request's acceptance."""
from __future__ import annotations

import doctest

import pytest

import workers.speculation as spec
from workers.drafters.base import NO_SPECULATION, TreeBudget
from workers.speculation import (SpeculationConfig, SpeculationState, best_depth, expected_tau, next_budget,
                                 record, step_cost)

STEEP = ((0, 1.0), (1, 1.6), (4, 1.8), (8, 2.1), (16, 2.5), (32, 4.6))
FLAT = ((0, 1.0), (64, 1.1))  # e.g. a GPU: verifying 64 nodes costs about as much as one
BASE = TreeBudget(32, 32)


def test_doctests():
    assert doctest.testmod(spec).failed == 0


@pytest.mark.parametrize("a,table,expect", [
    (0.0, STEEP, 0), (0.3, STEEP, 0), (0.8, STEEP, 10), (0.99, STEEP, 19),
    (0.3, FLAT, 5), (0.95, FLAT, 32), (0.0, FLAT, 0),
])
def test_best_depth(a, table, expect):
    assert best_depth(a, table, 32, 1.05) == expect


def test_best_depth_maximises_goodput_by_brute_force():
    for a in [i / 20 for i in range(21)]:
        d = best_depth(a, STEEP, 32, 1.0)
        gains = [expected_tau(a, k) / step_cost(k, STEEP) for k in range(33)]
        assert gains[d] == pytest.approx(max(gains))


def test_poor_acceptance_backs_off_to_zero():
    state = SpeculationState(SpeculationConfig(step_cost=STEEP))
    for _ in range(6):
        budget = next_budget(state, BASE)
        state = record(state, budget.max_nodes, 0)
    assert next_budget(state, BASE) == NO_SPECULATION


def test_speculation_comes_back_after_idle_steps_and_goes_deep_on_high_acceptance():
    cfg = SpeculationConfig(step_cost=STEEP)
    state = SpeculationState(cfg, accepted=0.0, rejected=6.0)
    assert next_budget(state, BASE) == NO_SPECULATION
    steps = 0
    while next_budget(state, BASE) == NO_SPECULATION:
        state = record(state, 0, 0)  # plain steps: no evidence, relax towards the prior
        steps += 1
        assert steps < 100
    assert steps > 1  # it waited before probing
    for _ in range(10):  # the probe and what follows are accepted in full
        b = next_budget(state, BASE)
        state = record(state, b.max_nodes, b.max_nodes)
    assert next_budget(state, BASE).max_depth >= 16


def test_high_acceptance_never_exceeds_the_base_budget():
    state = SpeculationState(accepted=100.0, rejected=0.0)
    assert next_budget(state, TreeBudget(6, 4)) == TreeBudget(4, 4)
    assert next_budget(state, NO_SPECULATION) == NO_SPECULATION


def test_record_validates_and_treats_empty_trees_as_no_evidence():
    s = SpeculationState(accepted=4.0, rejected=2.0)
    with pytest.raises(ValueError):
        record(s, 2, 3)
    idle = record(s, 0, 0)
    assert idle.acceptance == pytest.approx((4 * 0.95 + 3) / (6 * 0.95 + 4))
    full = record(s, 5, 5)
    assert full.rejected == pytest.approx(2 * 0.85)  # a path accepted to its end is no failure


def test_config_validation():
    with pytest.raises(ValueError):
        SpeculationConfig(step_cost=((1, 1.0), (2, 2.0)))
    with pytest.raises(ValueError):
        SpeculationConfig(decay=0)


def test_failed_probes_become_exponentially_rarer():
    state = SpeculationState(SpeculationConfig(step_cost=STEEP))
    probes = []
    for step in range(400):
        b = next_budget(state, BASE)
        if b.max_nodes:
            probes.append(step)
        state = record(state, b.max_nodes, 0)  # nothing is ever accepted
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert len(probes) < 12  # a tiny fraction of 400 steps pays for a tree
    assert gaps[-1] > 4 * gaps[1]


class _SlowPerfectDrafter:
    """Always proposes the true continuation (a chain), taking `delay` seconds per call."""
    name = "slow"

    def __init__(self, truth: dict[str, list[int]], delay: float):
        self.truth, self.delay = truth, delay

    def propose(self, ctx, budget):
        import time

        from workers.tree import TokenTree
        time.sleep(self.delay)
        done = len(ctx.tokens) - ctx.prompt_len
        return TokenTree.chain(self.truth[ctx.request_id][done: done + budget.max_depth])

    def release(self, request_id):
        pass


@pytest.mark.parametrize("plain_s, speculates", [(None, True), (0.001, False)])
def test_drafting_time_counts_against_speculation(tiny_model, plain_s, speculates):
    """A perfect drafter that takes 20 plain passes per call stops being used once its cost is
    known (plain_s set); without a plain-pass time, drafting counts as free and it keeps drafting."""
    from tests.helpers import hf_greedy
    from workers.acceptance import SamplingParams
    from workers.batch_worker import BatchWorker, WorkItem
    from workers.llama_forward import LlamaForward
    from workers.verifier import Verifier

    prompt = [5, 9, 13, 17]
    truth = hf_greedy(tiny_model, prompt, 40)
    worker = BatchWorker(Verifier(LlamaForward(tiny_model), max_tree_nodes=8),
                         speculation=SpeculationConfig(plain_s=plain_s),
                         drafters={"slow": _SlowPerfectDrafter({"r": truth}, 0.02)})
    worker.prefill("r", prompt, prompt_len=4, sampling=SamplingParams(), max_new_tokens=40, drafter="slow")
    drafted = [worker.step([WorkItem("r", TreeBudget(4, 4))])[0].drafted for _ in range(6)]
    assert drafted[0] > 0                        # the first step drafts on the prior
    assert (sum(drafted[1:]) > 0) == speculates, drafted
