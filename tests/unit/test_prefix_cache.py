"""Prefix cache: block bookkeeping on hand-made KV, then prefill through the verifier on the tiny
model (output identical with and without hits; tenants never share; eviction bounded)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers import hf_greedy
from workers.contract import SamplingParams
from workers.drafters.registry import create_drafter
from workers.contract import TreeBudget
from scheduler.generation import Engine, GenerationRequest
from workers.model.kv_cache import KVCache
from workers.model.llama_forward import LlamaForward
from workers.model.prefix_cache import PrefixCache
from workers.speculation.verifier import Verifier

B = 4


def filled(tokens: list[int]) -> KVCache:
    """A KV cache whose slot i holds the value tokens[i] everywhere: where a row came from shows."""
    kv = KVCache(2, 1, 3, 64)
    for i, t in enumerate(tokens):
        kv.k[:, :, i] = t
        kv.v[:, :, i] = -t
    kv.length = len(tokens)
    return kv


def restored(pc: PrefixCache, tenant: str, tokens: list[int]) -> list[int]:
    """The token each restored slot came from."""
    out = KVCache(2, 1, 3, 64)
    n = pc.restore(pc.match(tenant, tokens), out)
    return [int(out.k[0, 0, i, 0]) for i in range(n)]


def test_whole_blocks_of_the_longest_shared_prefix_are_found():
    pc = PrefixCache(16, block=B)
    first = list(range(10, 21))                      # 11 tokens: blocks [10..13], [14..17]
    pc.store("a", first, filled(first), [])
    assert len(pc) == 2
    assert restored(pc, "a", first[:8] + [99, 98, 97, 96]) == first[:8]
    assert restored(pc, "a", first[:6] + [99, 98]) == first[:4]       # the second block differs
    assert restored(pc, "a", [10, 11, 12]) == []                      # no whole block
    assert restored(pc, "a", [99] + first) == []                      # same tokens, other place


def test_tenants_never_share_a_prefix():
    pc = PrefixCache(16, block=B)
    tokens = list(range(1, 13))
    pc.store("a", tokens, filled(tokens), [])
    assert restored(pc, "b", tokens) == []
    assert restored(pc, "a", tokens) == tokens


def test_a_longer_prompt_adds_only_its_new_blocks():
    pc = PrefixCache(16, block=B)
    short = list(range(1, 9))
    pc.store("a", short, filled(short), [])
    longer = short + list(range(50, 58))
    chain = pc.match("a", longer)
    assert len(chain) == 2
    pc.store("a", longer, filled(longer), chain)
    assert len(pc) == 4 and restored(pc, "a", longer) == longer
    assert pc.computed_tokens == 8 + 8


def test_least_recently_used_goes_first_and_a_prefix_outlives_its_tails():
    pc = PrefixCache(4, block=B, tenant_share=1.0)     # one tenant: the whole capacity
    shared = [1, 2, 3, 4]
    x, y = shared + [5, 6, 7, 8], shared + [9, 10, 11, 12]
    pc.store("a", x, filled(x), [])
    pc.store("a", y, filled(y), pc.match("a", y))
    assert len(pc) == 3
    z = [20, 21, 22, 23, 24, 25, 26, 27]
    pc.store("a", z, filled(z), [])                   # 5 blocks > 4: the oldest tail (x's) goes
    assert len(pc) == 4
    assert restored(pc, "a", x) == shared and restored(pc, "a", y) == y
    assert restored(pc, "a", z) == z


def test_capacity_from_bytes():
    pc = PrefixCache.for_bytes(10 * 2**20, n_layers=30, n_kv_heads=3, head_dim=64, dtype=torch.float32)
    assert pc.capacity_blocks == 10 * 2**20 // (2 * 30 * 3 * 32 * 64 * 4)         # 6 blocks
    assert PrefixCache.for_bytes(1000, 30, 3, 64, torch.float32) is None
    with pytest.raises(ValueError):
        PrefixCache(0)


def test_usage_counts_the_blocks_held_against_the_capacity():
    per_block = 2 * 2 * 1 * B * 3 * 4                  # K and V, [2 layers, 1 head, B, 3] fp32
    pc = PrefixCache(4, block=B)
    assert pc.usage_bytes() == (0, 0)                  # a block's size shows with the first one
    tokens = list(range(1, 10))                        # two whole blocks
    pc.store("a", tokens, filled(tokens), [])
    assert pc.usage_bytes() == (2 * per_block, 4 * per_block)
    more = list(range(30, 50))                         # five more: LRU keeps it at capacity
    pc.store("b", more, filled(more), [])
    assert pc.usage_bytes() == (4 * per_block, 4 * per_block)
    sized = PrefixCache.for_bytes(10 * 2**20, 30, 3, 64, torch.float32)
    assert sized.usage_bytes() == (0, sized.capacity_blocks * 2 * 30 * 3 * 32 * 64 * 4)


def _distinct_prompts(n: int, blocks: int, start: int = 1000) -> list[list[int]]:
    return [list(range(start + i * 100, start + i * 100 + blocks * B)) for i in range(n)]


def test_one_tenants_many_prompts_leave_another_tenants_prefix_intact():
    """Tenant "a" sends many distinct long prompts: past its share it evicts its own blocks, and
    "b"'s cached prefix still hits in full."""
    pc = PrefixCache(8, block=B)                       # a tenant may hold 4 blocks
    mine = list(range(1, 1 + 2 * B))
    pc.store("b", mine, filled(mine), [])
    for p in _distinct_prompts(20, blocks=3):
        pc.store("a", p, filled(p), pc.match("a", p))
        assert pc.tenant_len("a") <= pc.tenant_blocks == 4
    assert restored(pc, "b", mine) == mine
    last = _distinct_prompts(20, blocks=3)[-1]
    assert restored(pc, "a", last) == last             # its own latest prompt still hits


def test_a_full_cache_takes_blocks_from_the_tenant_holding_the_most():
    pc = PrefixCache(6, block=B, tenant_share=1.0)     # no share cap: only the eviction order
    mine = list(range(1, 1 + 2 * B))
    pc.store("b", mine, filled(mine), [])
    for p in _distinct_prompts(10, blocks=2):
        pc.store("a", p, filled(p), [])
    assert len(pc) == 6 and pc.tenant_len("a") == 4
    assert restored(pc, "b", mine) == mine


def test_dropping_a_tenant_frees_its_blocks_and_stores_none_for_it_again():
    per_block = 2 * 2 * 1 * B * 3 * 4
    pc = PrefixCache(8, block=B)
    gone, kept = list(range(1, 1 + 3 * B)), list(range(200, 200 + 2 * B))
    pc.store("t-old", gone, filled(gone), [])
    pc.store("t-other", kept, filled(kept), [])
    assert pc.usage_bytes()[0] == 5 * per_block
    assert pc.drop_tenant("t-old") == 3
    assert pc.usage_bytes()[0] == 2 * per_block and pc.tenant_len("t-old") == 0
    assert restored(pc, "t-old", gone) == []
    pc.store("t-old", gone, filled(gone), [])         # a request of the removed tenant ends late
    assert restored(pc, "t-old", gone) == [] and len(pc) == 2
    assert restored(pc, "t-other", kept) == kept


# ---- through the verifier --------------------------------------------------------------------
EOS = 2


def shared_prompts(n: int = 6, seed: int = 3) -> list[list[int]]:
    """A 70-token preamble, then each request's own tail (as agentic tool schemas + a task)."""
    rng = np.random.default_rng(seed)
    preamble = rng.integers(3, 128, size=70).tolist()
    return [preamble + rng.integers(3, 128, size=int(rng.integers(1, 30))).tolist() for _ in range(n)]


@pytest.mark.parametrize("drafter", ["none", "ngram"])
def test_greedy_output_with_prefix_hits_is_identical(tiny_model, drafter):
    forward = LlamaForward(tiny_model)
    pc = PrefixCache(64, block=16)
    engine = Engine(Verifier(forward, max_tree_tokens=16, prefix_cache=pc), create_drafter(drafter),
                    TreeBudget(8, 4))
    ps = shared_prompts()
    for i, p in enumerate(ps):        # one at a time: each later request finds the preamble
        (res,) = engine.generate([GenerationRequest(f"r{i}", tuple(p), 24, SamplingParams(), frozenset({EOS}))])
        assert res.token_ids == hf_greedy(tiny_model, p, 24, eos=EOS)[:len(res.token_ids)]
        assert res.finish_reason == "stop" or len(res.token_ids) == 24
    assert pc.hit_tokens >= (len(ps) - 1) * 64          # 4 of the preamble's blocks, each time


def test_cached_rows_equal_computed_rows(tiny_model):
    """Logits after a prefill that hit the cache equal those after a full prefill (1e-5)."""
    forward = LlamaForward(tiny_model)
    p1, p2 = shared_prompts(2)
    plain = Verifier(forward, max_tree_tokens=4)
    cached = Verifier(forward, max_tree_tokens=4, prefix_cache=PrefixCache(64, block=16))
    cached.prefill("warm", p1, SamplingParams(), 4)
    for v in (plain, cached):
        v.prefill("x", p2, SamplingParams(), 4)
    assert cached.prefix_cache.hit_tokens == 64
    a, b = plain.book.slot("x").cache, cached.book.slot("x").cache
    assert a.length == b.length == len(p2) - 1
    torch.testing.assert_close(a.k[:, :, :a.length], b.k[:, :, :b.length], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a.v[:, :, :a.length], b.v[:, :, :b.length], atol=1e-5, rtol=1e-5)


def test_another_tenant_gets_no_hit_and_a_re_prefill_hits_its_own_prompt(tiny_model):
    forward = LlamaForward(tiny_model)
    pc = PrefixCache(64, block=16)
    v = Verifier(forward, max_tree_tokens=4, prefix_cache=pc)
    p = shared_prompts(1)[0]
    v.prefill("a1", p, SamplingParams(), 8, tenant="a")
    v.prefill("b1", p, SamplingParams(), 8, tenant="b")
    assert pc.hit_tokens == 0
    v.release("a1")
    v.prefill("a1", p + [5, 6, 7], SamplingParams(), 8, tenant="a")   # evicted, back with output
    assert pc.hit_tokens == (len(p) - 1) // 16 * 16
