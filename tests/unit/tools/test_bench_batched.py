"""The batched bench's serving path on the tiny model: speculative and plain agree, all served."""
from __future__ import annotations

import numpy as np

from tools.bench_batched import serve_all
from scheduler.profile import StepCostModel
from workers.contract import TreeBudget
from workers.model.llama_forward import LlamaForward
from workers.runtime import Runtime


def test_speculative_and_plain_serving_give_identical_greedy_outputs(tiny_model):
    rt = Runtime(tokenizer=None, forward=LlamaForward(tiny_model), hf_model=tiny_model,
                 stop_token_ids=frozenset({2}))
    rng = np.random.default_rng(0)
    motif = rng.integers(3, 128, size=4).tolist()
    prompts = [(f"p{i}", (motif * 10)[: 8 + 3 * i] if i % 2 else rng.integers(3, 128, size=9 + i).tolist())
               for i in range(7)]
    cost = StepCostModel.from_json(None)
    spec, _, spec_steps, request_steps = serve_all(rt, prompts, concurrency=3, max_tokens=24, drafter="ngram",
                                                   budget=TreeBudget(8, 4), profile=cost)
    plain, _, plain_steps, _ = serve_all(rt, prompts, concurrency=3, max_tokens=24, drafter="none",
                                         budget=TreeBudget(0, 0), profile=cost)
    assert len(spec) == len(prompts) and spec == plain
    assert request_steps >= spec_steps and spec_steps <= plain_steps


def test_the_planners_learned_priors_carry_from_one_pass_to_the_next(tiny_model):
    """`priors` is the planner's own learned state (Policy.priors): a pass that drafted leaves
    what it saw of the drafter there, and the next pass's planner starts from it."""
    from scheduler.alpha import DrafterPrior

    rt = Runtime(tokenizer=None, forward=LlamaForward(tiny_model), hf_model=tiny_model,
                 stop_token_ids=frozenset({2}))
    motif = [5, 9, 13, 17]
    prompts = [(f"p{i}", (motif * 10)[: 8 + 3 * i]) for i in range(4)]
    priors: dict = {}
    first, *_ = serve_all(rt, prompts, concurrency=2, max_tokens=16, drafter="ngram", budget=TreeBudget(8, 4),
                          profile=StepCostModel.from_json(None), priors=priors)
    (key, learned), = priors.items()
    assert key == ("bench", None) and isinstance(learned, DrafterPrior) and learned.accepted > 0
    again, *_ = serve_all(rt, prompts, concurrency=2, max_tokens=16, drafter="ngram", budget=TreeBudget(8, 4),
                          profile=StepCostModel.from_json(None), priors=priors)
    assert again == first and priors[key] != learned      # the same outputs; the evidence grew
