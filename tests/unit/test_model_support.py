"""Support or refuse, per feature (workers/model_support.py): a checkpoint whose config or weights
ask for what the lean forward does not compute is refused at load with the feature named; a
sliding-window model is served within its window, token-identical to transformers' greedy."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import spread_weights, tiny_llama
from tests.helpers import OracleDrafter, hf_greedy
from scheduler.generation import Engine, GenerationRequest
from workers.contract import SamplingParams, TreeBudget
from workers.drafters.base import NoneDrafter
from workers.llama_forward import LlamaForward
from workers.model_support import attention_window, unsupported
from workers.verifier import ContextLengthError, Verifier

EOS = 2


def _randomize(params) -> None:
    with torch.no_grad():
        for p in params:
            p.normal_(0, 0.5)


def test_a_plain_llama_is_fully_supported(tiny_model):
    assert unsupported(tiny_model) == []
    assert attention_window(tiny_model.config) is None
    assert LlamaForward(tiny_model).max_positions == tiny_model.config.max_position_embeddings


def test_trained_output_and_mlp_biases_are_refused_by_name():
    model = tiny_llama(4, attention_bias=True)
    assert unsupported(model) == []                       # zero o_proj biases change nothing
    _randomize(layer.self_attn.o_proj.bias for layer in model.model.layers)
    with pytest.raises(ValueError, match="o_proj bias"):
        LlamaForward(model)

    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(**{**tiny_llama().config.to_dict(), "mlp_bias": True})
    model = LlamaForCausalLM(cfg).eval()
    _randomize(layer.mlp.down_proj.bias for layer in model.model.layers)
    with pytest.raises(ValueError, match="MLP biases"):
        LlamaForward(model)


def test_an_activation_other_than_silu_is_refused_by_name():
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(**{**tiny_llama().config.to_dict(), "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        LlamaForward(LlamaForCausalLM(cfg).eval())


def tiny_mistral(window: int):
    from transformers import MistralConfig, MistralForCausalLM
    torch.manual_seed(11)
    base = tiny_llama().config.to_dict()
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
            "bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings")
    cfg = MistralConfig(**{k: base[k] for k in keep}, max_position_embeddings=512,
                        sliding_window=window)
    return spread_weights(MistralForCausalLM(cfg).eval())


@pytest.mark.parametrize("speculate", [False, True])
def test_a_sliding_window_model_is_served_within_its_window_token_identical(speculate):
    window = 24
    model = tiny_mistral(window)
    lf = LlamaForward(model)
    assert lf.window == window and lf.max_positions == window
    prompt, new = list(range(5, 13)), window - 8 - 1       # the whole sequence inside the window
    ref = hf_greedy(model, prompt, new, eos=None)
    req = GenerationRequest("m", tuple(prompt), new, SamplingParams(), frozenset())
    drafter = OracleDrafter({"m": ref}, 64, "mixed") if speculate else NoneDrafter()
    out = Engine(Verifier(lf, max_tree_tokens=8), drafter, TreeBudget(8, 4), adaptive=False).generate([req])
    assert out[0].token_ids == ref
    with pytest.raises(ContextLengthError):                # past the window: refused, not wrong
        Verifier(lf).prefill("long", list(range(3, 3 + window)), SamplingParams(), max_new_tokens=1)


def test_qwen2_attends_over_the_whole_context_unless_its_window_is_on():
    from transformers import Qwen2Config
    assert attention_window(Qwen2Config(sliding_window=64, use_sliding_window=False)) is None
    on = Qwen2Config(sliding_window=64, use_sliding_window=True, max_window_layers=0)
    assert attention_window(on) == 64
