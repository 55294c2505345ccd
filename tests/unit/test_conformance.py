"""The conformance matrix: for each architecture family the loader accepts, a tiny random-weight
model built from that family's real config fields decodes greedily through the engine (the
lean forward, the verifier, the step) token for token as transformers' own `generate` does,
with speculation off and on, on the CPU-kernel path and on the plain torch path.

    llama3          Llama 3.x: llama3 rope scaling, GQA 4, untied embeddings, head_dim 32
    smollm2         SmolLM2: tied embeddings, head_dim 64, GQA 3 (its 9/3 heads, scaled down)
    mha             no grouping (as many KV heads as query heads), head_dim 16
    mistral         Mistral with its sliding window (served within it: workers/model_support.py)
    qwen2           Qwen2/2.5: q/k/v biases (trained, not zero), untied embeddings, GQA 2
    qwen2-window    Qwen2 with use_sliding_window on

Sequences run past 32 positions: longer than llama3's original rope context, and up to the
windowed models' window (past it they are refused, tests/unit/test_model_support.py).
"""
from __future__ import annotations

import functools

import pytest
import torch

from tests.conftest import spread_weights
from tests.helpers import OracleDrafter, hf_greedy
from scheduler.generation import Engine, GenerationRequest
from workers import small_gemm
from workers.contract import SamplingParams, TreeBudget
from workers.drafters.base import NoneDrafter
from workers.llama_forward import LlamaForward
from workers.verifier import Verifier

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0)
WINDOW = 40
ARCHS = {
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, max_position_embeddings=256,
        tie_word_embeddings=False, rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                 "original_max_position_embeddings": 16})),
    "smollm2": ("LlamaConfig", "LlamaForCausalLM", dict(
        hidden_size=192, num_attention_heads=3, num_key_value_heads=1, head_dim=64,
        max_position_embeddings=256, tie_word_embeddings=True)),
    "mha": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=4, head_dim=16, max_position_embeddings=256,
        tie_word_embeddings=True)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=256,
        sliding_window=WINDOW, tie_word_embeddings=False)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=False, use_sliding_window=False)),
    "qwen2-window": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=True, use_sliding_window=True, sliding_window=WINDOW,
        max_window_layers=0)),
}
PROMPTS = [list(range(5, 17)), [7, 3, 9, 3, 7, 3, 9, 3, 11, 40, 41, 42]]
MAX_NEW = WINDOW - 12 - 1                 # the longest sequence fits the windowed models' window


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
                p.normal_(0, 0.3)         # Qwen2's q/k/v biases, trained-like
    return m


@functools.lru_cache(maxsize=None)
def references(arch: str) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(hf_greedy(model(arch), p, MAX_NEW, eos=None)) for p in PROMPTS)


def lean(arch: str, path: str) -> LlamaForward:
    lf = LlamaForward(model(arch))
    if path == "kernel":
        if not lf.fused_attention:
            pytest.skip("the CPU attention kernel serves head dims 64 and 128 on machines with "
                        "the kernels; this case runs on the torch path")
    else:
        lf.fused_attention, lf._stack = False, None
    return lf


@pytest.mark.parametrize("speculate", [False, True], ids=["plain", "speculative"])
@pytest.mark.parametrize("path", ["kernel", "torch"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_is_token_identical_to_transformers(arch, path, speculate):
    lf = lean(arch, path)
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
        assert set(kernel) == {"smollm2", "mistral"}       # head dim 64; the others run on torch
    else:
        assert kernel == []
