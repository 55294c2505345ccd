"""Logit rules at every tree row (workers/speculation/processors.py): penalties and logit_bias keep speculation
lossless, each row judged from its own path, and a re-admitted request's rules start from its
committed output."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from scheduler.generation import Engine, GenerationRequest
from tests.helpers import OracleDrafter
from workers.contract import SamplingParams, TreeBudget
from workers.drafters.base import NoneDrafter
from workers.drafters.registry import create_drafter
from workers.model.llama_forward import LlamaForward
from workers.speculation.processors import LogitBias, Penalties
from workers.speculation.tree import TokenTree
from workers.speculation.verifier import Verifier, VerifyItem

EOS = 2
MAX_NEW = 30


def reference(model, prompt, sampling: SamplingParams, max_new: int) -> list[int]:
    """Plain greedy decoding with the rules written out from OpenAI's definitions, over
    transformers' own logits: the output must equal this, whatever the drafts."""
    out: list[int] = []
    bias = dict(sampling.logit_bias)
    for _ in range(max_new):
        with torch.inference_mode():
            logits = model(torch.tensor([list(prompt) + out])).logits[0, -1]
        logits = logits.double().clone()                                          # [V]
        for tok, n in Counter(out).items():
            logits[tok] -= sampling.frequency_penalty * n + sampling.presence_penalty
        for tok, b in bias.items():
            logits[tok] += b
        nxt = int(logits.argmax())
        out.append(nxt)
        if nxt == EOS:
            break
    return out


def prompts(n: int = 4, seed: int = 3) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    motif = rng.integers(3, 128, size=4).tolist()
    return [(motif * 10)[: int(rng.integers(8, 30))] if i % 2 else rng.integers(3, 128, size=12).tolist()
            for i in range(n)]


RULES = {
    "frequency": SamplingParams(frequency_penalty=1.5),
    "presence": SamplingParams(presence_penalty=2.0),
    "both+bias": SamplingParams(presence_penalty=0.7, frequency_penalty=-0.4,
                                logit_bias=((5, 3.0), (7, -100.0), (11, 1.5))),
}


@pytest.fixture(scope="module")
def forward(tiny_model):
    return LlamaForward(tiny_model)


@pytest.fixture(scope="module")
def references(tiny_model):
    """(rule name or None) -> each prompt's reference output, computed once for the module."""
    return {name: [reference(tiny_model, p, sampling, MAX_NEW) for p in prompts()]
            for name, sampling in [*RULES.items(), (None, SamplingParams())]}


@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize("drafter", ["none", "ngram", "oracle-wide", "oracle-mixed"])
def test_greedy_under_penalties_and_bias_is_plain_decoding_under_them(forward, references, rule, drafter):
    sampling = RULES[rule]
    ps = prompts()
    refs = references[rule]
    assert refs != references[None], "the rule changes nothing here: the test could not fail"
    reqs = [GenerationRequest(f"r{i}", tuple(p), MAX_NEW, sampling, frozenset({EOS})) for i, p in enumerate(ps)]
    if drafter.startswith("oracle"):
        d = OracleDrafter({r.request_id: ref for r, ref in zip(reqs, refs)}, 128, drafter.split("-")[1])
    else:
        d = NoneDrafter() if drafter == "none" else create_drafter(drafter)
    engine = Engine(Verifier(forward, max_tree_tokens=16), d, TreeBudget(12, 6), adaptive=False)
    for res, ref in zip(engine.generate(reqs), refs):
        assert res.token_ids == ref


def test_each_row_counts_its_own_path_not_its_siblings():
    # root -> 5 -> 5, root -> 7: row 2 has seen 5 twice, row 3 (7) never saw a 5
    tree = TokenTree((5, 5, 7), (-1, 0, -1))
    rows = torch.zeros(4, 10)
    Penalties(presence=1.0, frequency=0.5, output=[7]).adjust(rows, tree)
    expected = torch.zeros(4, 10)
    expected[:, 7] -= 1.5                   # every row: the output's 7
    expected[1, 5] -= 1.5                   # row 1: one 5 on its path
    expected[2, 5] -= 2.0                   # row 2: two
    expected[3, 7] -= 0.5                   # row 3: a second 7, presence already paid
    assert torch.equal(rows, expected)


def test_bias_ignores_ids_past_the_vocabulary():
    rows = torch.zeros(2, 4)
    LogitBias(((1, 2.0), (9, 5.0)), vocab=4).adjust(rows, TokenTree.empty())
    assert rows[:, 1].tolist() == [2.0, 2.0] and float(rows.abs().sum()) == 4.0


def test_sampling_follows_the_biased_distribution(forward):
    # a +100 bias makes one token certain, a -100 one impossible, with or without drafts
    forced = SamplingParams(temperature=1.0, seed=11, logit_bias=((9, 100.0),))
    ver = Verifier(forward, max_tree_tokens=8)
    ver.prefill("s", [3, 4, 5, 6], forced, 8)
    for tree in (TokenTree.empty(), TokenTree.chain([9, 9, 4]), TokenTree((9, 4), (-1, -1))):
        (res,) = ver.verify([VerifyItem("s", tree)])
        assert set(res.tokens) == {9}


def test_a_readmitted_request_starts_its_penalties_from_its_output(tiny_model, forward):
    sampling = SamplingParams(frequency_penalty=2.0, presence_penalty=1.0)
    prompt = prompts()[1]
    ref = reference(tiny_model, prompt, sampling, 20)
    cut = 8
    ver = Verifier(forward, max_tree_tokens=8)
    # as after an eviction: prompt + committed output, the prompt's end given
    ver.prefill("again", prompt + ref[:cut], sampling, 20, prompt_len=len(prompt))
    out = list(ref[:cut])
    while len(out) < len(ref):
        (res,) = ver.verify([VerifyItem("again", TokenTree.empty())])
        out += res.tokens
    assert out[: len(ref)] == ref
