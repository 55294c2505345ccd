"""Support or refuse, per feature (workers/model/model_support.py): a checkpoint whose config or weights
ask for what the lean forward does not compute is refused at load with the feature named; what it
computes (biases on every projection, per-layer sliding windows) decodes token-identical to
transformers' greedy. The conformance matrix (test_conformance.py) covers each family; here,
prefills long enough for every attention path under a window."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import spread_weights, tiny_llama
from tests.helpers import OracleDrafter, hf_greedy
from scheduler.generation import Engine, GenerationRequest
from workers.model import packed_attention
from workers.contract import SamplingParams, TreeBudget
from workers.drafters.base import NoneDrafter
from workers.model.llama_forward import LlamaForward
from workers.model.model_support import layer_windows, unsupported
from workers.speculation.verifier import Verifier

EOS = 2


def _randomize(params) -> None:
    with torch.no_grad():
        for p in params:
            p.normal_(0, 0.5)


def test_a_plain_llama_is_fully_supported(tiny_model):
    assert unsupported(tiny_model) == []
    assert layer_windows(tiny_model.config) == [None, None]
    assert LlamaForward(tiny_model).max_positions == tiny_model.config.max_position_embeddings


def test_output_and_mlp_biases_are_computed_not_refused():
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(**{**tiny_llama().config.to_dict(), "attention_bias": True, "mlp_bias": True})
    model = spread_weights(LlamaForCausalLM(cfg).eval())
    _randomize(p for n, p in model.named_parameters() if n.endswith("bias"))
    assert unsupported(model) == []
    prompt = list(range(5, 15))
    ref = hf_greedy(model, prompt, 12, eos=None)
    out = Engine(Verifier(LlamaForward(model)), NoneDrafter(), TreeBudget(8, 4), adaptive=False).generate(
        [GenerationRequest("b", tuple(prompt), 12, SamplingParams(), frozenset())])
    assert out[0].token_ids == ref


def test_biases_on_some_of_q_k_v_are_computed_as_zeros_for_the_others():
    model = tiny_llama(4, attention_bias=True)
    _randomize(p for n, p in model.named_parameters() if n.endswith("bias"))
    for layer in model.model.layers:
        layer.self_attn.k_proj.bias = None               # q and v biased, k not
    assert unsupported(model) == []
    prompt = list(range(5, 15))
    ref = hf_greedy(model, prompt, 8, eos=None)
    out = Engine(Verifier(LlamaForward(model)), NoneDrafter(), TreeBudget(8, 4), adaptive=False).generate(
        [GenerationRequest("q", tuple(prompt), 8, SamplingParams(), frozenset())])
    assert out[0].token_ids == ref


def test_an_activation_other_than_silu_is_refused_by_name():
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(**{**tiny_llama().config.to_dict(), "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        LlamaForward(LlamaForCausalLM(cfg).eval())


def test_partial_rotary_and_softcapping_are_refused_by_name():
    from transformers import LlamaConfig, LlamaForCausalLM
    base = tiny_llama().config.to_dict()
    rope = {**base["rope_parameters"], "partial_rotary_factor": 0.5}
    with pytest.raises(ValueError, match="partial_rotary_factor=0.5"):
        LlamaForward(LlamaForCausalLM(LlamaConfig(**{**base, "rope_parameters": rope})).eval())
    model = tiny_llama()
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="final_logit_softcapping=30.0"):
        LlamaForward(model)


def test_dynamic_rope_is_exact_up_to_the_models_positions():
    """transformers rescales "dynamic" rope only past max_position_embeddings, which the forward
    never reaches, so its one cos/sin table is exact (test up to the last position)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    base = tiny_llama().config.to_dict()
    rope = {**base["rope_parameters"], "rope_type": "dynamic", "factor": 4.0}
    torch.manual_seed(3)
    model = spread_weights(LlamaForCausalLM(LlamaConfig(**{**base, "max_position_embeddings": 40,
                                                           "rope_parameters": rope})).eval())
    assert unsupported(model) == []
    lf = LlamaForward(model)
    prompt = list(range(5, 15))
    ref = hf_greedy(model, prompt, 40 - len(prompt), eos=None)
    out = Engine(Verifier(lf), NoneDrafter(), TreeBudget(8, 4), adaptive=False).generate(
        [GenerationRequest("d", tuple(prompt), 40 - len(prompt), SamplingParams(), frozenset())])
    assert out[0].token_ids == ref


def test_longrope_is_refused_where_the_context_can_pass_its_original_length():
    from transformers import Phi3Config, Phi3ForCausalLM
    dims = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, pad_token_id=0, eos_token_id=2)
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 16,   # head dim 32:
            "long_factor": [2.0] * 16, "original_max_position_embeddings": 64}           # 16 frequencies
    long = Phi3Config(**dims, max_position_embeddings=256, original_max_position_embeddings=64,
                      rope_parameters=rope)
    with pytest.raises(ValueError, match="longrope.*original_max_position_embeddings=64"):
        LlamaForward(Phi3ForCausalLM(long).eval())
    within = Phi3Config(**dims, max_position_embeddings=64, original_max_position_embeddings=64,
                        rope_parameters=rope)
    assert unsupported(Phi3ForCausalLM(within).eval()) == []


def test_an_attention_kind_other_than_full_or_sliding_is_refused_by_name():
    from transformers import Qwen3Config, Qwen3ForCausalLM
    cfg = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      layer_types=["full_attention", "chunked_attention"])
    with pytest.raises(ValueError, match="'chunked_attention'"):
        LlamaForward(Qwen3ForCausalLM(cfg).eval())


def tiny_mistral(window: int, head_dim: int = 64):
    from transformers import MistralConfig, MistralForCausalLM
    torch.manual_seed(11)
    base = tiny_llama().config.to_dict()
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
            "bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings")
    cfg = MistralConfig(**{k: base[k] for k in keep}, head_dim=head_dim, max_position_embeddings=1024,
                        sliding_window=window)
    return spread_weights(MistralForCausalLM(cfg).eval())


@pytest.mark.parametrize("speculate", [False, True], ids=["plain", "speculative"])
@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_long_prefills_past_the_window_are_token_identical(path, speculate):
    """Prompts long enough for every attention path: 100 rows (the kernel's causal prefill; on
    torch, blocks of rows), and more keys than the kernel takes (torch's blocked path beside the
    kernel's rope), each many windows past the window."""
    window = 24
    model = tiny_mistral(window)
    lf = LlamaForward(model)
    assert lf.windows == [window, window] and lf.max_positions == 1024
    if path == "torch":
        lf.fused_attention, lf._stack = False, None
    elif not lf.fused_attention:
        pytest.skip("no CPU kernels here: the torch case covers this machine")
    gen = torch.Generator().manual_seed(5)
    long = packed_attention.KERNEL_MAX_KEYS[torch.float32] + 40
    prompts = [torch.randint(3, 128, (n,), generator=gen).tolist() for n in (100, long)]
    new = 10
    refs = [hf_greedy(model, p, new, eos=None) for p in prompts]
    reqs = [GenerationRequest(f"m{i}", tuple(p), new, SamplingParams(), frozenset()) for i, p in enumerate(prompts)]
    drafter = (OracleDrafter({r.request_id: ref for r, ref in zip(reqs, refs)}, 64, "mixed")
               if speculate else NoneDrafter())
    out = Engine(Verifier(lf, max_tree_tokens=8), drafter, TreeBudget(8, 4), adaptive=False).generate(reqs)
    assert [o.token_ids for o in out] == refs


def test_qwen_windows_follow_use_sliding_window_and_max_window_layers():
    from transformers import Qwen2Config, Qwen3Config
    assert layer_windows(Qwen2Config(num_hidden_layers=3, sliding_window=64, use_sliding_window=False)) == [None] * 3
    on = Qwen2Config(num_hidden_layers=3, sliding_window=64, use_sliding_window=True, max_window_layers=1)
    assert layer_windows(on) == [None, 64, 64]
    types = Qwen3Config(num_hidden_layers=3, sliding_window=32, use_sliding_window=True,
                        layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    assert layer_windows(types) == [32, None, 32]


def test_mistral_windows_every_layer_and_a_draft_opts_out(tmp_path):
    """A draft's cache is packed to sink + window (slots are not positions), so a draft loaded
    from a windowed model's directory attends as its own masks say, with no window of the model's."""
    from workers.drafters.model import ModelDrafter
    model = tiny_mistral(16)
    assert layer_windows(model.config) == [16, 16]
    assert LlamaForward(model).windows == [16, 16]
    model.save_pretrained(tmp_path)
    assert ModelDrafter.load(tmp_path).forward.windows == [None, None]
