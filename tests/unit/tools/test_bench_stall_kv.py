"""The stall and KV benchmarks' arithmetic (their real-model runs are benchmarks, not tests), and
the builder's KV budget: the pool in slots at the model's bytes per slot."""
from __future__ import annotations

import doctest

import pytest

from scheduler import kv_budget
from tools import bench_stall
from tools.bench_kv import rss_bytes


def test_doctests():
    assert doctest.testmod(bench_stall).failed == 0
    assert doctest.testmod(kv_budget).failed == 0


def test_a_stream_that_ended_before_the_long_prompt_gives_no_figure():
    assert bench_stall.stream_gaps([0.0, 0.1, 0.2], t_send=1.0, t_done=2.0) is None
    assert bench_stall.stream_gaps([0.0, 0.1, 0.2, 0.3, 0.4], t_send=1.0, t_done=2.0) is None


def test_rss_is_read_from_proc():
    assert 10 * 2**20 < rss_bytes() < 64 * 2**30


def test_the_builder_turns_the_kv_pool_into_the_planners_slots(tiny_model):
    from gateway.assembly.target import kv_budget as budget_of
    from workers.model.llama_forward import LlamaForward
    from workers.speculation.verifier import Verifier

    f = LlamaForward(tiny_model)
    v = Verifier(f, max_tree_tokens=64, kv_pool_bytes=10 * 2**20)
    kv, note = budget_of(v)
    per = 2 * f.n_layers * f.n_kv_heads * f.head_dim * 4          # float32 K and V, every layer
    assert v.slot_bytes == per
    assert kv == {"kv_budget_tokens": 10 * 2**20 // per, "kv_block": v.kv_block, "kv_tree_tokens": 65}
    assert "10 MiB" in note
    assert budget_of(Verifier(f)) == ({}, None)


def test_the_prefix_cache_yields_its_blocks_to_the_requests_kv(tiny_model):
    import numpy as np

    from workers.contract import SamplingParams
    from workers.model.llama_forward import LlamaForward
    from workers.model.prefix_cache import PrefixCache
    from workers.speculation.verifier import Verifier

    f = LlamaForward(tiny_model)
    per = 2 * f.n_layers * f.n_kv_heads * f.head_dim * 4
    pc = PrefixCache.for_bytes(400 * per, f.n_layers, f.n_kv_heads, f.head_dim, f.kv_dtype, block=16)
    v = Verifier(f, max_tree_tokens=16, prefix_cache=pc, kv_block=8, kv_pool_bytes=500 * per)
    rng = np.random.default_rng(0)
    v.prefill("a", rng.integers(3, 128, size=300).tolist(), SamplingParams(), 4)
    assert v.kv_tokens() == 300 + 4 + 16 + 1             # prompt, its 4 tokens, a tree and root
    assert len(pc) == (500 - 321) // 16                  # what the request leaves of the pool
    v.prefill("b", rng.integers(3, 128, size=250).tolist(), SamplingParams(), 4)
    assert v.kv_tokens() > 500 and len(pc) == 0          # the requests need it all: none left
    v.release("a")
    v.prefill("c", rng.integers(3, 128, size=40).tolist(), SamplingParams(), 4)
    assert v.kv_tokens() < 500 - 2 * 16 and len(pc) == 39 // 16   # room again: c's blocks kept
    with pytest.raises(KeyError):
        v.pending("gone")
