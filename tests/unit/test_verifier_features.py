"""The verifier's features (`StepResult.features`): the target's own final-normed hidden state
where it read the last committed token, the same numbers transformers reports, at no extra pass."""
from __future__ import annotations

import pytest
import torch

from tests.helpers import hf_greedy
from workers.contract import SamplingParams
from workers.model.llama_forward import LlamaForward
from workers.speculation.tree import TokenTree
from workers.speculation.verifier import Verifier, VerifyItem


def hf_hidden(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model.model(torch.tensor([ids])).last_hidden_state[0]      # [T, H], after the norm


def test_features_are_the_hidden_state_of_the_last_committed_token(tiny_model):
    prompt = [5, 9, 13, 17, 21]
    truth = hf_greedy(tiny_model, prompt, 8)
    v = Verifier(LlamaForward(tiny_model), max_tree_tokens=8, features=True)
    v.prefill("r", prompt, SamplingParams(), 20)
    (first,) = v.verify([VerifyItem("r", TokenTree.empty())])           # plain step: the root
    want = hf_hidden(tiny_model, prompt)[-1]
    assert first.tokens == (truth[0],)
    assert torch.allclose(torch.tensor(first.features), want, atol=1e-4)
    # a chain: two right drafts, then a wrong one; the bonus comes from the second draft's row
    chain = TokenTree.chain([truth[1], truth[2], 0 if truth[3] else 1])
    (second,) = v.verify([VerifyItem("r", chain)])
    assert second.accepted == 2 and second.tokens == tuple(truth[1:4])
    want = hf_hidden(tiny_model, prompt + truth[:3])[-1]
    assert torch.allclose(torch.tensor(second.features), want, atol=1e-4)


def test_no_features_unless_asked(tiny_model):
    v = Verifier(LlamaForward(tiny_model), max_tree_tokens=8)
    v.prefill("r", [5, 9, 13], SamplingParams(), 4)
    assert v.verify([VerifyItem("r", TokenTree.empty())])[0].features is None


@pytest.mark.parametrize("batch", [1, 3])
def test_features_do_not_depend_on_the_batch(tiny_model, batch):
    prompts = [[5, 9, 13, 17], [7, 11], [3, 4, 5, 6, 7, 8]][:batch]
    v = Verifier(LlamaForward(tiny_model), max_tree_tokens=8, features=True)
    for i, p in enumerate(prompts):
        v.prefill(f"r{i}", p, SamplingParams(), 4)
    got = v.verify([VerifyItem(f"r{i}", TokenTree.empty()) for i in range(batch)])
    for p, res in zip(prompts, got):
        assert torch.allclose(torch.tensor(res.features), hf_hidden(tiny_model, p)[-1], atol=1e-4)


def test_prefill_reports_the_prompts_features_and_keeps_the_kv_right(tiny_model):
    """With features on, the prefill gives the hidden state at the prompt's last token (what a
    length predictor reads before the first step); the step that follows sees the same KV, so the
    output is unchanged and the first step's features match."""
    prompt = [5, 9, 13, 17, 21, 4, 8]
    truth = hf_greedy(tiny_model, prompt, 6)
    v = Verifier(LlamaForward(tiny_model), max_tree_tokens=8, features=True)
    done = v.prefill("r", prompt, SamplingParams(), 20)
    assert done.cached == 0
    assert torch.allclose(torch.tensor(done.features), hf_hidden(tiny_model, prompt)[-1], atol=1e-4)
    out = []
    for _ in range(6):
        (res,) = v.verify([VerifyItem("r", TokenTree.empty())])
        if not out:
            assert torch.allclose(torch.tensor(res.features), torch.tensor(done.features), atol=1e-5)
        out += res.tokens
    assert out == truth
    plain = Verifier(LlamaForward(tiny_model), max_tree_tokens=8)
    assert plain.prefill("r", prompt, SamplingParams(), 20).features is None


def test_prefill_features_with_the_whole_context_from_the_prefix_cache(tiny_model):
    from workers.model.prefix_cache import PrefixCache

    lf = LlamaForward(tiny_model)
    cache = PrefixCache.for_bytes(2**24, lf.n_layers, lf.n_kv_heads, lf.head_dim, lf.kv_dtype)
    v = Verifier(lf, max_tree_tokens=8, features=True, prefix_cache=cache)
    prompt = list(range(5, 5 + 3 * cache.block + 1))     # whole blocks, then the root
    v.prefill("a", prompt, SamplingParams(), 8)
    again = v.prefill("b", prompt, SamplingParams(), 8)
    assert again.cached == len(prompt) - 1
    assert torch.allclose(torch.tensor(again.features), hf_hidden(tiny_model, prompt)[-1], atol=1e-4)
