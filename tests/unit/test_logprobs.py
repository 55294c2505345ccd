"""logprobs from the verification pass (workers/speculation/step_acceptance.py `committed_logprobs`): every committed
token's log-probability and its position's top-k equal log_softmax of transformers' logits at that
position, whatever the tree (none, right and wrong branches), greedy or sampled, and under
penalties (read from the raw logits, before any rule changes them)."""
from __future__ import annotations

import pytest
import torch

from tests.helpers import OracleDrafter
from workers.contract import DraftContext, SamplingParams, TreeBudget
from workers.model.llama_forward import LlamaForward
from workers.speculation.tree import TokenTree
from workers.speculation.verifier import Verifier, VerifyItem

PROMPT = [5, 17, 33, 9, 41, 17, 33, 9, 12]
MAX_NEW = 24
K = 5


@pytest.fixture(scope="module")
def forward(tiny_model):
    return LlamaForward(tiny_model)


def generate(forward, sampling: SamplingParams, drafter: OracleDrafter | None):
    """Run one request step by step; (tokens, logprob entries, steps that accepted a draft)."""
    ver = Verifier(forward, max_tree_tokens=12)
    ver.prefill("r", PROMPT, sampling, MAX_NEW)
    tokens, entries, accepted = [], [], 0
    while len(tokens) < MAX_NEW:
        tree = (drafter.propose(DraftContext("r", "t", PROMPT + tokens, len(PROMPT)), TreeBudget(10, 5))
                if drafter is not None else TokenTree.empty())
        (res,) = ver.verify([VerifyItem("r", tree)])
        assert res.logprobs is not None and len(res.logprobs) == len(res.tokens)
        tokens += res.tokens
        entries += res.logprobs
        accepted += res.accepted
    return tokens[:MAX_NEW], entries[:MAX_NEW], accepted


def reference(model, tokens: list[int]) -> torch.Tensor:
    """transformers' log_softmax at every output position: [len(tokens), V] float32."""
    with torch.inference_mode():
        logits = model(torch.tensor([PROMPT + tokens])).logits[0].float()        # [P + T, V]
    return torch.log_softmax(logits[len(PROMPT) - 1: len(PROMPT) - 1 + len(tokens)], dim=-1)


SAMPLINGS = {
    "greedy": SamplingParams(logprobs=K),
    # through speculative sampling's acceptance (top_k=1 so drafts are accepted on this random
    # model's flat logits: tree rows are exercised)
    "sampled": SamplingParams(temperature=1.0, top_k=1, seed=3, logprobs=K),
    "penalised": SamplingParams(frequency_penalty=1.5, logit_bias=((7, 4.0),), logprobs=K),
}


@pytest.mark.parametrize("name", sorted(SAMPLINGS))
@pytest.mark.parametrize("shape", [None, "wide", "mixed"])
def test_logprobs_are_the_targets_log_softmax_at_each_position(tiny_model, forward, name, shape):
    sampling = SAMPLINGS[name]
    plain, _, _ = generate(forward, sampling, None)        # what the oracle's right branches hold
    drafter = OracleDrafter({"r": plain}, 128, shape, seed=1) if shape else None
    tokens, entries, accepted = generate(forward, sampling, drafter)
    if sampling.greedy:
        assert tokens == plain                 # lossless: the same text with drafts
    if shape:
        assert accepted > 0, "no draft accepted: the test would not exercise tree rows"
    ref = reference(tiny_model, tokens)
    for j, (tok, (lp, top)) in enumerate(zip(tokens, entries)):
        assert lp == pytest.approx(float(ref[j, tok]), abs=1e-4)
        ref_v, ref_i = torch.topk(ref[j], K)
        assert [t for t, _ in top] == ref_i.tolist()
        assert [v for _, v in top] == pytest.approx(ref_v.tolist(), abs=1e-4)


def test_logprobs_are_raw_not_adjusted(forward):
    # +100 on token 9 makes it certain; its raw logprob is what the model thinks, far below 0
    ver = Verifier(forward, max_tree_tokens=4)
    ver.prefill("b", PROMPT, SamplingParams(logit_bias=((9, 100.0),), logprobs=0), 4)
    (res,) = ver.verify([VerifyItem("b", TokenTree.chain([9, 9]))])
    assert set(res.tokens) == {9} and len(res.tokens) == 3
    assert all(lp < -1.0 and top == () for lp, top in res.logprobs)


def test_no_logprobs_unless_asked(forward):
    ver = Verifier(forward, max_tree_tokens=4)
    ver.prefill("n", PROMPT, SamplingParams(), 4)
    (res,) = ver.verify([VerifyItem("n", TokenTree.chain([3]))])
    assert res.logprobs is None
