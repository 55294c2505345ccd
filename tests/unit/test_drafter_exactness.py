"""The suffix and merged drafters change only the speed, never the output.

Greedy: on the tiny random model, speculative greedy ids equal plain greedy (transformers'
``generate``) with ``suffix`` and ``merge:ngram+suffix``, in a first round (the request's own text
only) and a second round of the same prompts (the tenant's cache now holds the first round's
outputs), and a tenant's results do not depend on another tenant's cache.
Sampling: merged trees keep multi-step speculative sampling distribution-preserving, on the toy
Markov target of test_sampling_distribution.py (same G-test).
"""
from __future__ import annotations

import numpy as np
import pytest

import workers.speculation.acceptance as acceptance
from tests.helpers import hf_greedy
from tests.unit.test_engine import prompts  # half repeat a motif: the request's own text matches
from tests.unit.test_sampling_distribution import EXACT_FIRST, EXACT_PAIR, P, ROOT, TRIALS, V, _no_residual, check
from workers.speculation.acceptance import accept_sampling
from workers.contract import SamplingParams
from workers.contract import NO_SPECULATION, DraftContext, TreeBudget
from workers.drafters.merge import MergeDrafter
from workers.drafters.ngram import NgramDrafter
from workers.drafters.registry import create_drafter
from workers.drafters.suffix import SuffixDrafter
from scheduler.generation import Engine, GenerationRequest
from workers.model.llama_forward import LlamaForward
from workers.speculation.verifier import Verifier

EOS = 2
MAX_NEW = 32
N_PROMPTS = 5
BUDGET = TreeBudget(8, 8)


@pytest.fixture(scope="module")
def forward(tiny_model):
    return LlamaForward(tiny_model)


@pytest.fixture(scope="module")
def references(tiny_model):
    return [hf_greedy(tiny_model, p, MAX_NEW, eos=EOS) for p in prompts(N_PROMPTS)]


def generate(forward, drafter, tag: str, tenant: str = "t"):
    reqs = [GenerationRequest(f"{tag}{i}", tuple(p), MAX_NEW, SamplingParams(), frozenset({EOS}), tenant)
            for i, p in enumerate(prompts(N_PROMPTS))]
    return Engine(Verifier(forward, max_tree_tokens=16), drafter, BUDGET, adaptive=False).generate(reqs)


@pytest.mark.parametrize("name", ["suffix", "merge:ngram+suffix"])
def test_greedy_speculation_is_token_identical_to_plain_greedy(forward, references, name):
    drafter = create_drafter(name)
    first = generate(forward, drafter, "first")
    second = generate(forward, drafter, "second")  # same prompts: the tenant's cache knows the outputs
    for results in (first, second):
        assert [r.token_ids for r in results] == references
    accepted = [sum(r.accepted for r in results) for results in (first, second)]
    steps = [sum(r.steps for r in results) for results in (first, second)]
    assert accepted[0] > 0, "the test must exercise drafting"
    assert steps[1] < steps[0], (steps, "the cached outputs should make the second round faster")


def test_another_tenants_cache_changes_nothing(forward, references):
    busy = create_drafter("merge:ngram+suffix")
    generate(forward, busy, "a", tenant="a")  # tenant a's cache now holds these very outputs
    on_busy = generate(forward, busy, "b", tenant="b")
    on_fresh = generate(forward, create_drafter("merge:ngram+suffix"), "b", tenant="b")
    assert [(r.token_ids, r.steps, r.accepted, r.drafted) for r in on_busy] == \
        [(r.token_ids, r.steps, r.accepted, r.drafted) for r in on_fresh]
    assert [r.token_ids for r in on_busy] == references


# --- multi-step speculative sampling with merged trees ------------------------------------------


@pytest.fixture(scope="module")
def merged_trees():
    return build_merged_trees()


def build_merged_trees():
    """The merged tree (and proposers) for a context ending at ROOT and for each one-token extension.

    Own text ``0 2 3 1 2 4 5 2``: ngram matches "2" twice (→ 4 5 2, → 3 1 2); suffix finds the longer
    "4 5 2" in the tenant's earlier outputs (→ 1 1 0): the root gets siblings from both drafters.
    """
    drafter = MergeDrafter([NgramDrafter(min_ngram=1, max_ngram=3), SuffixDrafter(min_match=1, min_prob=0.05)])
    for i, output in enumerate([[5, 2, 1, 0, 3, 4], [4, 5, 2, 1, 1, 0], [3, 5, 2, 0]]):
        drafter.propose(DraftContext(f"old{i}", "t", output, 0), NO_SPECULATION)
        drafter.release(f"old{i}")
    base = [0, 2, 3, 1, 2, 4, 5, 2]
    assert base[-1] == ROOT
    return {extra: drafter.propose_merged(DraftContext(f"q{extra}", "t", base + list(extra), len(base)), TreeBudget(8, 4))
            for extra in [()] + [(x,) for x in range(V)]}


def first_two_tokens(trees, seed: int, trials: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    counts = np.zeros((V, V), dtype=np.int64)
    for _ in range(trials):
        tokens: tuple[int, ...] = ()
        while len(tokens) < 2:
            tree = trees[tokens[:1]].tree
            root = tokens[0] if tokens else ROOT
            tokens += accept_sampling(tree, lambda row: P[root if row == 0 else tree.tokens[row - 1]], rng).tokens
        counts[tokens[0], tokens[1]] += 1
    return counts


def test_merged_trees_are_meaningful(merged_trees):
    base = merged_trees[()]
    assert [(tok, who) for tok, par, who in zip(base.tree.tokens, base.tree.parents, base.proposers) if par == -1] \
        == [(4, ("ngram",)), (3, ("ngram",)), (1, ("suffix",))]  # siblings at the root: residuals matter
    proposers = {who for m in merged_trees.values() for who in m.proposers}
    assert {("ngram",), ("suffix",), ("ngram", "suffix")} <= proposers
    assert all(m.tree.draft_probs is None for m in merged_trees.values())  # deterministic: q one-hot


def test_sampling_with_merged_trees_follows_the_target(merged_trees):
    p_first, p_pair = check(first_two_tokens(merged_trees, seed=5, trials=TRIALS))
    assert p_first > 1e-3 and p_pair > 1e-3, (p_first, p_pair, EXACT_FIRST, EXACT_PAIR)


def test_detects_a_broken_residual_on_merged_trees(monkeypatch, merged_trees):
    monkeypatch.setattr(acceptance, "_residual", _no_residual)
    assert min(check(first_two_tokens(merged_trees, seed=6, trials=TRIALS // 2))) < 1e-3
