"""Shared fixtures: a tiny random-weight Llama (fast unit tests), the real default model (slow tests),
and a real Redis server with a fresh key prefix per test (tests/redis_server.py; never a mock)."""
from __future__ import annotations

from typing import Iterator

import pytest

from redis_server import delete_prefix, redis_server, unique_prefix


def tiny_llama(seed: int = 0, *, vocab: int = 128, layers: int = 2, max_positions: int = 512,
               attention_bias: bool = False, head_dim: int = 64):
    import torch                       # here, not at the top: scheduler tests load no torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                      max_position_embeddings=max_positions,
                      rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
                      attention_bias=attention_bias, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    # head_dim 64 (wider than hidden / heads), as SmolLM2's: the CPU attention kernel serves it
    return spread_weights(LlamaForCausalLM(cfg).eval())


def spread_weights(model):
    """Larger-than-default init of every weight matrix: it spreads the logits, so greedy ties
    (which would make exactness comparisons depend on rounding) are vanishingly rare."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    return model


@pytest.fixture(scope="session")
def tiny_model():
    return tiny_llama()


@pytest.fixture(scope="session")
def real_runtime():
    """The real default model (SmolLM2-135M-Instruct, fp32), with the transformers reference kept."""
    from workers.runtime import load_runtime

    return load_runtime(keep_hf=True)


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """$REDIS_URL, or an embedded redis-server started once per session and removed after."""
    with redis_server() as url:
        yield url


@pytest.fixture
def redis_prefix(redis_url: str) -> Iterator[str]:
    """A key prefix no other test (or real deployment) uses; its keys are deleted afterwards."""
    prefix = unique_prefix()
    yield prefix
    delete_prefix(redis_url, prefix)
