"""The engine on the real default model (SmolLM2-135M-Instruct, float32): lossless on real text."""
from __future__ import annotations

import pytest

from loadtest.workload import load_workload
from tests.helpers import hf_greedy
from workers.contract import SamplingParams
from workers.contract import TreeBudget
from workers.drafters.registry import create_drafter
from scheduler.generation import Engine, GenerationRequest
from workers.prompts import encode_record

pytestmark = pytest.mark.slow
MAX_NEW = 48


@pytest.fixture(scope="module")
def cases(real_runtime):
    records = [load_workload(w)[i] for w, i in [("copy", 0), ("extract", 1), ("chat", 0), ("code", 2)]]
    records.append({"prompt": "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"})
    ids = [encode_record(real_runtime.tokenizer, r) for r in records]
    refs = [hf_greedy(real_runtime.hf_model, p, MAX_NEW, eos=sorted(real_runtime.stop_token_ids)) for p in ids]
    return ids, refs


@pytest.mark.parametrize("drafter,budget", [("ngram", TreeBudget(24, 10)), ("ngram", TreeBudget(8, 8)),
                                            ("none", TreeBudget(0, 0))])
def test_greedy_ids_equal_transformers_generate(real_runtime, cases, drafter, budget):
    ids, refs = cases
    engine = Engine(real_runtime.verifier(), create_drafter(drafter), budget)
    reqs = [GenerationRequest(f"r{i}", tuple(p), MAX_NEW, SamplingParams(), real_runtime.stop_token_ids)
            for i, p in enumerate(ids)]
    results = engine.generate(reqs)  # all prompts in one batch
    for res, ref in zip(results, refs):
        assert res.token_ids == ref


def test_sampling_is_reproducible_per_seed_and_batch_independent(real_runtime, cases):
    ids, _ = cases
    engine = Engine(real_runtime.verifier(), create_drafter("ngram"), TreeBudget(16, 8))
    reqs = [GenerationRequest(f"s{i}", tuple(p), 24, SamplingParams(temperature=0.8, top_p=0.95, seed=7 + i),
                              real_runtime.stop_token_ids) for i, p in enumerate(ids[:3])]
    together = engine.generate(reqs)
    alone = engine.generate(reqs[1:2])[0]
    assert together[1].token_ids == alone.token_ids
    assert all(len(r.token_ids) > 0 for r in together)


def test_agentic_prompts_reuse_their_shared_preamble_and_stay_identical(real_runtime):
    """The agentic workload's prompts share ~380 tokens of tool schemas: after the first, each
    prefill computes only its own tail, and greedy output still equals transformers'."""
    rt = real_runtime
    ids = [encode_record(rt.tokenizer, r) for r in load_workload("agentic")[:3]]
    verifier = rt.verifier()
    engine = Engine(verifier, create_drafter("suffix"), TreeBudget(16, 8))
    pc = verifier.prefix_cache
    for i, p in enumerate(ids):
        hits = pc.hit_tokens
        (res,) = engine.generate([GenerationRequest(f"a{i}", tuple(p), 24, SamplingParams(), rt.stop_token_ids)])
        ref = hf_greedy(rt.hf_model, p, 24, eos=sorted(rt.stop_token_ids))
        assert res.token_ids == ref, i
        if i:
            assert pc.hit_tokens - hits >= 320
