"""The conformance matrix: for each architecture family the loader accepts, a tiny random-weight
model built from that family's real config fields decodes greedily through the engine (the
lean forward, the verifier, the step) token for token as transformers' own `generate` does,
with speculation off and on, on each CPU-kernel path this machine runs and on the plain torch path.

    arch            what it covers                                             head dim  GQA
    llama3          llama3 rope scaling, untied embeddings                         32       4
    smollm2         tied embeddings (SmolLM2's 9/3 heads, scaled down)             64       3
    mha             no grouping                                                    16       1
    llama-bias      trained q/k/v, o_proj and MLP biases (attention_bias, mlp_bias) 64      2
    llama-d256      a wide head (Gemma's size)                                    256       2
    mistral         its sliding window on every layer                              64       2
    qwen2           trained q/k/v biases, untied embeddings                        16       2
    qwen2-window    use_sliding_window on every layer (max_window_layers 0)        16       2
    qwen2-mixed     full attention on layer 0, the window on layers 1-2            32       2
    qwen3           q/k norms (trained), head_dim wider than hidden / heads        32       2
    qwen3-window    q/k norms and a window on the last layer (Phi-3's head dim)    96       2
    phi3            fused qkv_proj / gate_up_proj weights, its window on every layer 96      2

Windows are WINDOW tokens and every sequence runs several windows past it (prompt + output
longer than 3 windows), so each windowed layer's mask binds on most steps: prefill, plain steps
and trees alike. Norm weights and biases are random (trained-like), not their neutral init.
"""
from __future__ import annotations

import functools

import pytest
import torch

from tests.conftest import spread_weights
from tests.helpers import OracleDrafter, hf_greedy
from tests.kernel_paths import use_kernel_path
from scheduler.generation import Engine, GenerationRequest
from workers.model import small_gemm
from workers.contract import SamplingParams, TreeBudget
from workers.drafters.base import NoneDrafter
from workers.model.llama_forward import LlamaForward
from workers.speculation.verifier import Verifier

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0, max_position_embeddings=256)
WINDOW = 12
QWEN_WINDOW = dict(use_sliding_window=True, sliding_window=WINDOW)
ARCHS = {
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 16})),
    "smollm2": ("LlamaConfig", "LlamaForCausalLM", dict(
        hidden_size=192, num_attention_heads=3, num_key_value_heads=1, head_dim=64, tie_word_embeddings=True)),
    "mha": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=4, head_dim=16, tie_word_embeddings=True)),
    "llama-bias": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, attention_bias=True, mlp_bias=True)),
    "llama-d256": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_attention_heads=2, num_key_value_heads=1, head_dim=256)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=WINDOW,
        tie_word_embeddings=False)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, use_sliding_window=False)),
    "qwen2-window": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, max_window_layers=0,
        **QWEN_WINDOW)),
    "qwen2-mixed": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, max_window_layers=1, **QWEN_WINDOW)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True)),
    "qwen3-window": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        num_attention_heads=2, num_key_value_heads=1, head_dim=96, tie_word_embeddings=False,
        max_window_layers=1, **QWEN_WINDOW)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(
        hidden_size=192, num_attention_heads=2, num_key_value_heads=1, sliding_window=WINDOW,
        tie_word_embeddings=False)),
}
PROMPTS = [list(range(5, 17)), [7, 3, 9, 3, 7, 3, 9, 3, 11, 40, 41, 42]]
MAX_NEW = 3 * WINDOW + 4                  # every sequence ends 4 windows long, past the window
# The rows the CPU attention kernel serves where it runs (its head dims); the rest run on torch.
KERNEL_ARCHS = {"llama3", "smollm2", "llama-bias", "llama-d256", "mistral", "qwen2-mixed", "qwen3",
                "qwen3-window", "phi3"}


@functools.lru_cache(maxsize=None)
def model(arch: str):
    import transformers
    cfg_name, model_name, fields = ARCHS[arch]
    torch.manual_seed(sorted(ARCHS).index(arch))
    cfg = getattr(transformers, cfg_name)(**{**COMMON, **fields})
    m = spread_weights(getattr(transformers, model_name)(cfg).eval())
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.3)         # biases, trained-like
            elif name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)      # norms' gains (Qwen3's q/k norms among them), trained-like
    return m


@functools.lru_cache(maxsize=None)
def references(arch: str) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(hf_greedy(model(arch), p, MAX_NEW, eos=None)) for p in PROMPTS)


def lean(arch: str, path: str, monkeypatch) -> LlamaForward:
    """The lean forward on `path`: a kernel path of PATHS (each this CPU runs, in turn), or torch's."""
    if path != "torch":
        if not small_gemm.available(torch.float32):
            pytest.skip(f"no CPU kernels here: {small_gemm.unavailable_reason}")
        use_kernel_path(path, monkeypatch)
    lf = LlamaForward(model(arch))
    if path != "torch":
        if not lf.fused_attention:
            pytest.skip(f"the CPU attention kernel serves head dims {small_gemm.ATTENTION_HEAD_DIMS} on "
                        f"machines with the kernels; this case runs on the torch path")
    else:
        lf.fused_attention, lf._stack = False, None
    return lf


@pytest.mark.parametrize("speculate", [False, True], ids=["plain", "speculative"])
@pytest.mark.parametrize("path", [*small_gemm.PATHS, "torch"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_is_token_identical_to_transformers(arch, path, speculate, monkeypatch):
    lf = lean(arch, path, monkeypatch)
    refs = references(arch)
    reqs = [GenerationRequest(f"r{i}", tuple(p), MAX_NEW, SamplingParams(), frozenset())
            for i, p in enumerate(PROMPTS)]
    drafter = (OracleDrafter({r.request_id: list(ref) for r, ref in zip(reqs, refs)}, 64, "mixed")
               if speculate else NoneDrafter())
    out = Engine(Verifier(lf, max_tree_tokens=8), drafter, TreeBudget(8, 4), adaptive=False).generate(reqs)
    assert [tuple(o.token_ids) for o in out] == list(refs)
    if speculate:
        assert sum(o.accepted for o in out) > 0           # trees were verified, not skipped


def test_the_matrix_covers_both_attention_paths_where_the_kernels_exist():
    kernel = [a for a in ARCHS if LlamaForward(model(a)).fused_attention]
    if small_gemm.available(torch.float32):
        assert set(kernel) == KERNEL_ARCHS
    else:
        assert kernel == []


@pytest.mark.parametrize("arch", ["mistral", "qwen2-window", "qwen2-mixed", "qwen3-window", "phi3"])
def test_the_windowed_rows_decode_differently_without_their_window(arch):
    """The windowed rows test the window: the same weights attending over the whole context
    decode other tokens, so a forward that ignored the window would fail the matrix."""
    import transformers
    cfg_name, model_name, fields = ARCHS[arch]
    full = {**COMMON, **fields, "sliding_window": None, "use_sliding_window": False}
    unwindowed = getattr(transformers, model_name)(getattr(transformers, cfg_name)(**full)).eval()
    unwindowed.load_state_dict(model(arch).state_dict())
    assert LlamaForward(unwindowed).windows == [None] * full["num_hidden_layers"]
    assert tuple(tuple(hf_greedy(unwindowed, p, MAX_NEW, eos=None)) for p in PROMPTS) != references(arch)
