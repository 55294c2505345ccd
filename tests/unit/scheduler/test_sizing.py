"""Tree sizing (scheduler/sizing.py): the one α estimator (scheduler/alpha.py), the one sizing
rule, and that the worker carries out the budget it is handed instead of sizing again."""
from __future__ import annotations

import doctest

import pytest

import scheduler.alpha as alpha
import scheduler.sizing as sizing
import scheduler.step_cost as step_cost
from scheduler.alpha import AlphaEstimate, observe, observe_draft_time
from scheduler.profile import StepCostModel
from scheduler.sizing import urgency, SizingConfig, TreeSizer, expected_tau, size_trees
from scheduler.step_cost import LinearStepCost
from scheduler.request import StepRecord
from workers.contract import NO_SPECULATION, TreeBudget

# step seconds over tree tokens at batch 1: a plain pass 40 ms, a tree of 1 node 1.6x, of 32
# nodes 4.6x (a steep CPU curve; a GPU's would be nearly flat)
STEEP = StepCostModel([(1, [1, 2, 5, 9, 17, 33], [0.040, 0.064, 0.072, 0.084, 0.100, 0.184])])
BATCH = StepCostModel.from_json()                      # the shipped profile, batches 1-8
DEEP = SizingConfig(max_tree_tokens=32, max_depth=32)


@pytest.mark.parametrize("module", [alpha, sizing, step_cost])
def test_doctests(module):
    assert doctest.testmod(module).failed == 0


@pytest.mark.parametrize("alpha, depth, tau", [
    (0.0, 5, 1.0), (0.5, 0, 1.0), (0.5, 1, 1.5), (0.5, 3, 1.875), (1.0, 4, 5.0)])
def test_expected_tau(alpha, depth, tau):
    assert expected_tau(alpha, depth) == pytest.approx(tau)
    assert expected_tau(alpha, depth) == pytest.approx(sum(alpha ** k for k in range(depth + 1)))


@pytest.mark.parametrize("alphas, spare, kw, nodes", [
    ([0.8, 0.5, 0.05], 100, dict(config=SizingConfig(min_node_gain=0.2)), [7, 2, 0]),   # α^k ≥ 0.2
    ([0.9, 0.9], 100, dict(config=SizingConfig(max_tree_tokens=3)), [3, 3]),           # the cap
    ([0.9, 0.9], 100, dict(caps=[None, 2]), [8, 2]),                    # a request's own cap
    ([0.9, 0.9], 100, dict(caps=[0, 50]), [0, 8]),                      # 0: no speculation
    ([0.9, 0.9, 0.9, 0.9], 6, {}, None),                                # spare shared out: Σ = 6
    ([0.99], 2, {}, [2]),
    ([0.5, 0.6], 0, {}, [0, 0]),                                        # no spare tokens
    ([], 10, {}, []),
])
def test_size_trees(alphas, spare, kw, nodes):
    got = size_trees(alphas, spare, **kw)
    assert sum(b.max_nodes for b in got) <= spare
    assert all(b.max_depth <= b.max_nodes for b in got)
    if nodes is None:
        assert sum(b.max_nodes for b in got) == spare
    else:
        assert [b.max_nodes for b in got] == nodes


def test_max_depth_caps_depth_not_nodes():
    got = size_trees([0.95], 20, config=SizingConfig(max_tree_tokens=10, max_depth=4))
    assert got == [TreeBudget(10, 4)]


def test_costly_tokens_mean_smaller_trees():
    flat = LinearStepCost(fixed_s=0.05, per_token_s=1e-6)  # a token costs next to nothing
    steep = LinearStepCost(fixed_s=0.04, per_token_s=0.01)  # each token costs a quarter of a step
    alphas = [0.7] * 4
    cfg = SizingConfig(min_node_gain=0.01)
    free = sum(b.max_nodes for b in size_trees(alphas, 60, cost=flat, config=cfg))
    dear = sum(b.max_nodes for b in size_trees(alphas, 60, cost=steep, config=cfg))
    assert dear < free


@pytest.mark.parametrize("alpha", [i / 20 for i in range(20)] + [0.99])
def test_at_batch_one_the_sized_depth_is_near_the_best_goodput(alpha):
    """The node-by-node rule against brute force over every depth whose nodes are each worth
    min_node_gain: within 3% of the best goodput, and no speculation unless the best depth beats
    plain decoding by min_goodput_gain."""
    (b,) = size_trees([alpha], 64, cost=STEEP, config=DEEP)
    allowed = [d for d in range(33) if d == 0 or alpha ** d > DEEP.min_node_gain]
    goodput = [expected_tau(alpha, d) / STEEP(1, 1 + d) for d in allowed]
    plain = goodput[0]
    if max(goodput) < DEEP.min_goodput_gain * plain:
        assert b == NO_SPECULATION
    else:
        assert goodput[allowed.index(b.max_nodes)] >= 0.97 * max(goodput)


def test_a_slow_drafter_gets_shallower_trees_and_none_when_it_costs_more_than_it_gives():
    a = [0.8]
    free = size_trees(a, 64, cost=STEEP, config=DEEP)[0].max_nodes
    slow = size_trees(a, 64, cost=STEEP, config=DEEP, draft_s=[0.004])[0].max_nodes
    slower = size_trees(a, 64, cost=STEEP, config=DEEP, draft_s=[0.05])[0].max_nodes
    assert free > slow > slower == 0


def test_the_planners_fast_sizer_matches_the_exact_rule_on_a_homogeneous_batch():
    sizer = TreeSizer(BATCH)
    for n in (1, 4, 8):
        for a in (0.3, 0.6, 0.85):
            alphas = [a] * n
            assert sizer(alphas, 64 - n) == size_trees(alphas, 64 - n, cost=BATCH)


def test_the_planners_fast_sizer_sizes_requests_with_drafting_time_exactly():
    sizer = TreeSizer(STEEP, DEEP)
    assert sizer([0.8], 64, draft_s=[0.004]) == size_trees([0.8], 64, cost=STEEP, config=DEEP,
                                                           draft_s=[0.004])


def test_the_planner_gives_zero_nodes_when_acceptance_is_near_zero():
    profile = StepCostModel.from_json()
    for n in (1, 4, 8):
        assert [b.max_nodes for b in size_trees([0.02] * n, 64, cost=profile)] == [0] * n
        assert [b.max_nodes for b in TreeSizer(profile)([0.02] * n, 64)] == [0] * n
    mixed = size_trees([0.9, 0.02, 0.9], 64, cost=profile)
    assert mixed[1] == NO_SPECULATION and mixed[0].max_nodes > 0


def test_the_planner_gives_zero_nodes_when_the_batch_is_compute_bound():
    steep = LinearStepCost(per_token_s=0.001)    # every row, root or draft, costs the same: no spare compute
    alphas = [0.9] * 32
    assert all(b == NO_SPECULATION for b in size_trees(alphas, 256, cost=steep))
    assert all(b == NO_SPECULATION for b in TreeSizer(steep)(alphas, 256))
    cheap = LinearStepCost(fixed_s=0.04, per_token_s=0.0001)  # the same batch with cheap rows drafts
    assert all(b.max_nodes > 0 for b in size_trees(alphas, 256, cost=cheap))


def test_observe_validates_and_treats_empty_trees_as_no_evidence():
    e = AlphaEstimate(accepted=4.0, rejected=2.0)
    with pytest.raises(ValueError):
        observe(e, 2, 3)
    idle = observe(e, 0, 0)
    assert idle.alpha == pytest.approx((4 * 0.95 + 3) / (6 * 0.95 + 4))
    full = observe(e, 5, 5)
    assert full.rejected == pytest.approx(2 * 0.85)   # a path accepted to its end is no failure
    assert observe_draft_time(e, 1.0, 0) == e          # no levels drafted: nothing to learn


def _run(estimate: AlphaEstimate, steps: int, accept_all: bool) -> tuple[AlphaEstimate, list[int]]:
    """`steps` steps of one request sized at batch 1 on STEEP; returns the nodes of each."""
    nodes = []
    for _ in range(steps):
        (b,) = size_trees([estimate.alpha], 64, cost=STEEP, config=DEEP)
        nodes.append(b.max_nodes)
        estimate = observe(estimate, b.max_nodes, b.max_nodes if accept_all else 0)
    return estimate, nodes


def test_poor_acceptance_backs_off_to_zero():
    _, nodes = _run(AlphaEstimate(), 8, accept_all=False)
    assert nodes[0] > 0 and nodes[-1] == 0


def test_speculation_comes_back_after_idle_steps_and_goes_deep_on_high_acceptance():
    e = AlphaEstimate(accepted=0.0, rejected=6.0)
    assert size_trees([e.alpha], 64, cost=STEEP, config=DEEP) == [NO_SPECULATION]
    steps = 0
    while size_trees([e.alpha], 64, cost=STEEP, config=DEEP) == [NO_SPECULATION]:
        e = observe(e, 0, 0)                         # plain steps: relax towards the prior
        steps += 1
        assert steps < 100
    assert steps > 1                                 # it waited before probing
    e, nodes = _run(e, 10, accept_all=True)          # the probe and what follows accepted in full
    assert nodes[-1] >= 16


def test_failed_probes_become_exponentially_rarer():
    _, nodes = _run(AlphaEstimate(), 400, accept_all=False)
    probes = [i for i, n in enumerate(nodes) if n]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert len(probes) < 12                          # a tiny fraction of 400 steps pays for a tree
    assert gaps[-1] > 4 * gaps[1]


class _SlowPerfectDrafter:
    """Always proposes the true continuation (a chain), taking `delay` seconds per call."""

    def __init__(self, truth: list[int], delay: float):
        self.truth, self.delay = truth, delay

    def make(self):
        import time

        from workers.drafters.base import Drafter
        from workers.speculation.tree import TokenTree

        outer = self

        class Slow(Drafter):
            name = "slow"

            def propose(self, ctx, budget):
                time.sleep(outer.delay)
                done = len(ctx.tokens) - ctx.prompt_len
                return TokenTree.chain(outer.truth[done: done + budget.max_depth])
        return Slow()


@pytest.mark.parametrize("delay, speculates", [(0.0, True), (0.05, False)])
def test_drafting_time_counts_against_speculation_end_to_end(tiny_model, delay, speculates):
    """The worker reports each request's drafting time; sized by it, a perfect drafter that takes
    longer per level than a whole step stops being used after its first (timed) tree, and a free
    one keeps drafting."""
    from scheduler.generation import Engine, GenerationRequest
    from tests.helpers import hf_greedy
    from workers.model.llama_forward import LlamaForward
    from workers.speculation.verifier import Verifier

    prompt = (5, 9, 13, 17)
    truth = hf_greedy(tiny_model, list(prompt), 40)
    cost = StepCostModel([(1, [1, 9], [0.01, 0.012])])
    engine = Engine(Verifier(LlamaForward(tiny_model), max_tree_tokens=8),
                    _SlowPerfectDrafter(truth, delay).make(), TreeBudget(4, 4), step_cost=cost)
    (res,) = engine.generate([GenerationRequest("r", prompt, 30)])
    assert res.token_ids == truth[:30]
    assert res.drafted > 0                           # the first step drafts on the prior
    assert (res.drafted > 4) == speculates, res.drafted


def test_the_worker_drafts_the_budget_it_is_handed_whatever_was_accepted(tiny_model):
    """Sizing is the planner's alone: a worker handed 4 nodes a step drafts 4 nodes every step,
    even when none is ever accepted (before, it shrank trees on its own evidence)."""
    from workers.batch_worker import BatchWorker
    from workers.contract import SamplingParams, WorkItem
    from workers.drafters.base import Drafter
    from workers.model.llama_forward import LlamaForward
    from workers.speculation.tree import TokenTree
    from workers.speculation.verifier import Verifier

    class Wrong(Drafter):
        name = "wrong"

        def propose(self, ctx, budget):                # token 0: never what the target says
            return TokenTree.chain([0] * budget.max_depth)

    worker = BatchWorker(Verifier(LlamaForward(tiny_model), max_tree_tokens=8),
                         drafters={"wrong": Wrong()})
    worker.prefill("r", [5, 9, 13], prompt_len=3, sampling=SamplingParams(), max_new_tokens=40,
                   drafter="wrong")
    results = [worker.step([WorkItem("r", TreeBudget(4, 4))])[0] for _ in range(8)]
    assert [r.drafted for r in results] == [4] * 8
    assert all(r.accepted == 0 and r.draft_depth == 4 and r.draft_s >= 0 for r in results)


def test_urgency_moves_nodes_to_the_request_nearest_its_end():
    """The latency-aware rule (off by default: it measured worse, see sizing.py): of two
    requests alike in α, the one predicted nearer its end gets the deeper tree, and an urgency of
    1 everywhere is the goodput rule itself."""
    cost = LinearStepCost(fixed_s=0.040, per_request_s=0.002, per_token_s=0.001)
    cfg = SizingConfig(max_tree_tokens=16, max_depth=16, min_node_gain=0.01)
    plain = size_trees([0.7, 0.7], 64, cost=cost, config=cfg)
    assert size_trees([0.7, 0.7], 64, cost=cost, config=cfg, urgency=[1.0, 1.0]) == plain
    near, far = size_trees([0.7, 0.7], 64, cost=cost, config=cfg, urgency=urgency([5, 200], 0.5))
    assert near.max_nodes > plain[0].max_nodes >= far.max_nodes
    sizer = TreeSizer(cost, cfg)
    near, far = sizer([0.7, 0.7], 64, urgency=urgency([5, 200], 0.5))
    assert near.max_nodes > far.max_nodes


def test_a_cost_curve_flat_over_the_tree_sizes_gives_drafting_requests_no_tree():
    """A measured profile can be flat (or dip) between a step of roots and a step of full trees:
    a tree node then costs nothing, and a request that spends any time drafting gains nothing
    from it. Sizing gives it no tree (it used to divide by its zero worth), and a request that
    drafts for free keeps its tree."""
    flat = LinearStepCost(fixed_s=0.05)
    out = size_trees([0.8, 0.8], 20, cost=flat, draft_s=[0.003, 0.0])
    assert out[0] == NO_SPECULATION and out[1].max_nodes > 0
    assert TreeSizer(flat)([0.8, 0.8], 20, draft_s=[0.003, 0.0]) == out
    assert size_trees([0.8], 20, cost=flat, draft_s=[0.003]) == [NO_SPECULATION]


def _drafting_steps(policy, state, rids, *, drafted, accepted, draft_s=0.004, steps=12):
    """`steps` steps in which each of `rids` drafts a chain of `drafted`, `accepted` of it accepted."""
    from scheduler.request import StepRecord
    for k in range(steps):
        policy.plan(state, 0.1 * k)
        records = [StepRecord(rid, 1 + drafted, 1 + accepted, None, accepted + (accepted < drafted),
                              drafted, accepted, draft_s * drafted, drafted) for rid in rids]
        policy.update(state, records, 0.1 * k + 0.1, 0.1)


def test_new_requests_start_from_what_their_tenant_showed_of_their_drafter():
    """The prior is learned per (tenant, drafter): a new request of a tenant whose requests
    accepted little from a draft model starts at that acceptance and knows its drafting time;
    another tenant's request, or the same tenant's with another drafter, starts from 3 : 1 and
    free drafting; a removed tenant's evidence is forgotten."""
    from sched_helpers import stats
    from scheduler.policies import make_policy
    from scheduler.state import SchedulerState

    policy, state = make_policy("fcfs", max_batch=4, aging_bound_s=None), SchedulerState()
    for rid in ("a", "b"):
        s = stats(rid, tenant="t", predicted=None)
        s.drafter = "drafts/smol"
        policy.add(state, s)
    _drafting_steps(policy, state, ["a", "b"], drafted=4, accepted=1)   # α ≈ 1 ÷ 2
    def newcomer(rid, tenant, drafter):
        s = stats(rid, tenant=tenant, predicted=None)
        s.drafter = drafter
        policy.add(state, s)
        return s.estimate
    same = newcomer("c", "t", "drafts/smol")
    assert same.alpha == pytest.approx(0.5, abs=0.05)
    assert same.draft_s == pytest.approx(0.004)
    assert same.accepted == same.rejected == 0            # no evidence of its own
    assert newcomer("d", "u", "drafts/smol") == AlphaEstimate()
    assert newcomer("e", "t", "ngram") == AlphaEstimate()
    policy.drop_tenant("t")
    assert newcomer("f", "t", "drafts/smol") == AlphaEstimate()


def test_a_learned_prior_stops_the_probes_a_fixed_prior_makes_under_load():
    """8 requests at once on the shipped batch profile: at the fixed prior (3 : 1, drafting
    free until timed) every new request's first step drafts; once its tenant's requests showed
    a draft model accepting about half at 2 ms a level, a new wave of 8 starts with no trees at
    all, while a request alone, where verifying nodes costs little, still drafts from the same
    prior."""
    from sched_helpers import stats
    from scheduler.policies import make_policy
    from scheduler.state import SchedulerState

    policy = make_policy("fcfs", max_batch=8, token_budget=8 * 5, aging_bound_s=None, step_cost=BATCH,
                         sizing=SizingConfig(max_tree_tokens=4, max_depth=4))
    state = SchedulerState()

    def wave(prefix, n=8):
        ids = [f"{prefix}{i}" for i in range(n)]
        for rid in ids:
            s = stats(rid, predicted=None)
            s.drafter = "drafts/smol"
            policy.add(state, s)
        return ids, policy.plan(state, 0.0)

    def finish(ids):
        policy.update(state, [StepRecord(rid, 1, 1, "stop") for rid in ids], 2.0, 0.1)

    ids, first = wave("a")
    assert len(first.entries) == 8 and all(b.max_nodes > 0 for _, b in first.entries)
    _drafting_steps(policy, state, ids, drafted=4, accepted=1, draft_s=0.002)
    finish(ids)
    ids, second = wave("b")
    assert len(second.entries) == 8 and all(b.max_nodes == 0 for _, b in second.entries)
    finish(ids)
    _, alone = wave("c", 1)
    assert alone.entries[0][1].max_nodes > 0
