"""The cheap draft head (FR-Spec): frequencies, the restricted logits, greedy exactness with the
draft alone and merged with the n-gram drafter, and `specgate draft head` on a draft directory."""
from __future__ import annotations

import pytest
import torch

from scheduler.generation import Engine, GenerationRequest
from tests.conftest import tiny_llama
from tests.helpers import hf_greedy
from tests.unit.test_engine import prompts
from workers.drafters.neural.cheap_head import CheapHead, count_tokens, frequent_tokens, read_head
from workers.contract import SamplingParams, TreeBudget
from workers.drafters.neural.draft_model import DraftSpec
from workers.drafters.merge import MergeDrafter
from workers.drafters.model import ModelDrafter
from workers.drafters.ngram import NgramDrafter
from workers.model.llama_forward import LlamaForward
from workers.speculation.verifier import Verifier

EOS = 2


def test_counts_and_the_most_frequent_tokens():
    counts = count_tokens([[1, 1, 4], [4, 4, 0], [9]], 10)
    assert counts.tolist() == [1, 2, 0, 0, 3, 0, 0, 0, 0, 1]
    assert frequent_tokens(counts, 2).tolist() == [1, 4]
    assert frequent_tokens(counts, 3, always=[2]).tolist() == [0, 1, 2, 4]    # tie 0/9: the lower id
    with pytest.raises(ValueError):
        frequent_tokens(counts, 0)


def test_the_cheap_head_is_the_full_head_on_the_kept_tokens():
    weight = torch.randn(50, 16)
    kept = torch.tensor([3, 7, 20, 49])
    hidden = torch.randn(5, 16)
    out = CheapHead(weight, kept)(hidden)
    full = hidden @ weight.T
    assert out.shape == (5, 50)
    torch.testing.assert_close(out[:, kept], full[:, kept])
    dropped = torch.ones(50, dtype=torch.bool)
    dropped[kept] = False
    assert torch.isneginf(out[:, dropped]).all()


@pytest.mark.parametrize("merged", [False, True], ids=["alone", "merged-with-ngram"])
def test_greedy_output_is_identical_with_a_cheap_head_draft(tiny_model, merged):
    """The draft (another random model, so it is often wrong) keeps a third of the vocabulary:
    the target still decides every token."""
    draft_model = tiny_llama(1)
    forward = LlamaForward(draft_model, windowed=False)
    forward.lm_head = CheapHead(draft_model.lm_head.weight, torch.arange(0, 128, 3))
    draft = ModelDrafter(forward, DraftSpec(sink=2, window=8), name="cheap")
    drafter = MergeDrafter([draft, NgramDrafter()]) if merged else draft
    reqs = [GenerationRequest(f"r{i}", tuple(p), 24, SamplingParams(), frozenset({EOS}))
            for i, p in enumerate(prompts(5))]
    out = Engine(Verifier(LlamaForward(tiny_model), max_tree_tokens=16), drafter, TreeBudget(10, 4),
                 adaptive=False).generate(reqs)
    for res, p in zip(out, prompts(5)):
        assert res.token_ids == hf_greedy(tiny_model, p, 24, eos=EOS)
    assert sum(r.drafted for r in out) > 0


def test_draft_head_command_writes_the_kept_tokens(tmp_path):
    from specgate.cli import main
    from tests.helpers import tiny_model_dir
    from tools.draft_build import build_draft
    from workers.drafters.registry import create_drafter

    target = tiny_model_dir(tmp_path / "target")
    draft = build_draft(str(target), tmp_path / "draft", layers="first1", sink=2, window=16, progress=False)
    assert main(["draft", "head", "--draft", str(draft), "--tokens", "500"]) == 0
    kept = read_head(draft)
    assert 500 <= len(kept) <= 501 and 2 in kept.tolist()          # the stop token always stays
    drafter = create_drafter(str(draft))
    assert isinstance(drafter.forward.lm_head, CheapHead)
    assert main(["draft", "head", "--draft", str(draft), "--tokens", "0"]) == 0
    assert read_head(draft) is None
