"""Speculative generation through the verifier: lossless greedy, batch invariance, bad inputs."""
from __future__ import annotations

import numpy as np
import pytest

from tests.helpers import OracleDrafter, hf_greedy
from workers.contract import SamplingParams
from workers.drafters.base import NoneDrafter
from workers.contract import TreeBudget
from workers.drafters.registry import create_drafter
from scheduler.generation import Engine, GenerationRequest
from workers.model.llama_forward import LlamaForward
from workers.speculation.verifier import ContextLengthError, Verifier

EOS = 2
MAX_NEW = 40


def prompts(n: int = 10, seed: int = 0) -> list[list[int]]:
    """Prompts of varied length; half repeat a motif, so n-gram drafts sometimes hit."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = int(rng.integers(1, 60))
        if i % 2:
            motif = rng.integers(3, 128, size=int(rng.integers(2, 6))).tolist()
            p = (motif * 30)[:length]
        else:
            p = rng.integers(3, 128, size=length).tolist()
        out.append(p)
    return out


@pytest.fixture(scope="module")
def forward(tiny_model):
    return LlamaForward(tiny_model)


@pytest.fixture(scope="module")
def references(tiny_model):
    return [hf_greedy(tiny_model, p, MAX_NEW, eos=EOS) for p in prompts()]


def run(forward, drafter, reqs, budget=TreeBudget(12, 6), adaptive=True):
    return Engine(Verifier(forward, max_tree_tokens=16), drafter, budget, adaptive=adaptive).generate(reqs)


def greedy_requests(ps, max_new=MAX_NEW):
    return [GenerationRequest(f"r{i}", tuple(p), max_new, SamplingParams(), frozenset({EOS})) for i, p in enumerate(ps)]


@pytest.mark.parametrize("budget", [TreeBudget(1, 1), TreeBudget(4, 4), TreeBudget(12, 6), TreeBudget(16, 16)])
@pytest.mark.parametrize("drafter", ["none", "ngram", "oracle-chain", "oracle-wide", "oracle-mixed"])
def test_greedy_speculation_is_token_identical_to_plain_greedy(forward, references, drafter, budget):
    ps = prompts()
    reqs = greedy_requests(ps)
    if drafter.startswith("oracle"):
        d = OracleDrafter({r.request_id: ref for r, ref in zip(reqs, references)}, 128, drafter.split("-")[1])
    else:
        d = create_drafter(drafter)
    # Alone and all together: both must equal the reference.
    together = run(forward, d, reqs, budget, adaptive=False)
    for res, ref in zip(together, references):
        assert res.token_ids == ref
    for req, ref in zip(reqs[:3], references[:3]):
        assert run(forward, d, [req], budget, adaptive=False)[0].token_ids == ref


def test_oracle_trees_accept_and_commit_several_tokens_per_step(forward, references):
    reqs = greedy_requests(prompts())
    d = OracleDrafter({r.request_id: ref for r, ref in zip(reqs, references)}, 128, "chain")
    results = run(forward, d, reqs, TreeBudget(8, 8), adaptive=False)
    assert sum(r.accepted for r in results) > 0
    assert sum(len(r.token_ids) for r in results) > sum(r.steps for r in results)


def test_sampled_requests_get_the_same_output_alone_or_in_a_mixed_batch(forward):
    ps = prompts(8, seed=3)
    temps = [0.0, 0.7, 1.0, 1.3, 0.0, 0.9, 1.1, 0.5]
    reqs = [GenerationRequest(f"s{i}", tuple(p), 30, SamplingParams(temperature=t, top_k=(0 if i % 3 else 20),
                                                                     top_p=(0.9 if i % 2 else 1.0), seed=100 + i),
                              frozenset({EOS}))
            for i, (p, t) in enumerate(zip(ps, temps))]
    together = run(forward, create_drafter("ngram"), reqs)
    alone = [run(forward, create_drafter("ngram"), [r])[0] for r in reqs]
    for a, b in zip(together, alone):
        assert a.token_ids == b.token_ids
    # Different seeds give different samples (the RNG really is per request).
    other = run(forward, create_drafter("ngram"), [GenerationRequest("x", reqs[2].prompt_ids, 30,
                SamplingParams(temperature=1.0, seed=999), frozenset({EOS}))])[0]
    assert other.token_ids != alone[2].token_ids


def test_a_seeded_sampled_request_says_the_same_with_any_drafts_or_none(forward, references):
    """Seeded requests use the coupled rule (workers/speculation/acceptance.py `accept_coupled`): their text
    is a function of the seed alone, so speculation, its drafter and the tree budget change how
    fast it comes, not what it says (a restarted gateway continues the same text)."""
    ps = prompts(4, seed=5)
    reqs = [GenerationRequest(f"c{i}", tuple(p), 40, SamplingParams(temperature=0.9, top_p=0.95, seed=7 + i),
                              frozenset({EOS})) for i, p in enumerate(ps)]
    plain = run(forward, create_drafter("none"), reqs)
    ngram = run(forward, create_drafter("ngram"), reqs)
    # an oracle drafting the greedy text: often wrong for a sampled request, sometimes right
    oracle = OracleDrafter({r.request_id: ref for r, ref in zip(reqs, references)}, 128, "chain")
    drafted = run(forward, oracle, reqs, TreeBudget(8, 8), adaptive=False)
    for a, b, c in zip(plain, ngram, drafted):
        assert a.token_ids == b.token_ids == c.token_ids
    assert sum(r.accepted for r in ngram + drafted) > 0          # the drafts did take part


def test_max_tokens_and_stop_tokens_end_generation(forward, references):
    ps = prompts()
    res = run(forward, create_drafter("ngram"), greedy_requests(ps, max_new=5))
    for r, ref in zip(res, references):
        assert r.token_ids == ref[:5] or (EOS in ref[:5] and r.token_ids == ref[: ref.index(EOS) + 1])
        assert r.finish_reason == ("stop" if r.token_ids[-1] == EOS else "length")


def test_bad_inputs_raise_clear_errors(forward):
    eng = Engine(Verifier(forward), NoneDrafter(), TreeBudget(4, 4))
    with pytest.raises(ValueError, match="empty"):
        eng.generate([GenerationRequest("a", (), 5)])
    with pytest.raises(ValueError, match="max_tokens"):
        eng.generate([GenerationRequest("a", (5, 6), 0)])
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-0.5)
    with pytest.raises(ValueError, match="unknown drafter 'nope'"):
        create_drafter("nope")
    with pytest.raises(ContextLengthError, match="context is 512 tokens"):
        eng.generate([GenerationRequest("a", tuple([5] * 600), 5)])
    assert eng.verifier.active() == []  # nothing leaked by the failures


def test_generation_near_the_context_limit_stops_at_the_limit(forward):
    eng = Engine(Verifier(forward), create_drafter("ngram"), TreeBudget(8, 8))
    res = eng.generate([GenerationRequest("a", tuple([5, 6, 7] * 169), 50)])[0]  # 507 of 512 positions
    assert len(res.token_ids) == 5 and res.finish_reason == "length"


def test_bf16_speculation_equals_own_plain_bf16_decoding_except_near_ties():
    """bf16 lossless: speculative greedy = the same engine's plain bf16 greedy, or a near-tie.

    On CPU the bf16 forward keeps its KV in bf16 where the attention kernel runs (float32
    arithmetic) and in float32 where torch attends, and its linears in a packed layout; none of
    it may make a tree pass disagree with a one-token pass beyond bf16 rounding.
    """
    import torch

    from tests.conftest import tiny_llama
    from tools.near_tie import classify

    fwd = LlamaForward(tiny_llama().to(torch.bfloat16))
    kv = torch.bfloat16 if fwd.fused_attention else torch.float32
    assert fwd.kv_dtype == kv and fwd.new_cache(4).k.dtype == kv
    ps = prompts()
    plain = run(fwd, NoneDrafter(), greedy_requests(ps), adaptive=False)
    spec = run(fwd, create_drafter("ngram"), greedy_requests(ps), TreeBudget(16, 8), adaptive=False)
    verdicts = [classify(fwd, p, s.token_ids, q.token_ids) for p, s, q in zip(ps, spec, plain)]
    assert "divergent" not in verdicts, verdicts
    assert verdicts.count("identical") >= len(ps) // 2, verdicts
    assert sum(r.accepted for r in spec) > 0          # the trees really were verified


@pytest.mark.parametrize("kv_block", [1, 3, 16])
def test_kv_grows_in_blocks_and_greedy_output_is_unchanged(forward, references, kv_block):
    """KV is not reserved for prompt + max_tokens: a request starts with room for its prompt, a
    block and a tree, and grows as it commits tokens; the output is the plain greedy one."""
    ps = prompts()
    reqs = greedy_requests(ps)
    d = OracleDrafter({r.request_id: ref for r, ref in zip(reqs, references)}, 128, "mixed")
    ver = Verifier(forward, max_tree_tokens=16, kv_block=kv_block)
    caps: dict[str, list[int]] = {}
    real_verify = ver.verify

    def spy(batch):
        out = real_verify(batch)
        for i in batch:
            caps.setdefault(i.request_id, []).append(ver.book.slots[i.request_id].cache.capacity)
        return out

    ver.verify = spy
    res = Engine(ver, d, TreeBudget(12, 6), adaptive=False).generate(reqs)
    for r, ref in zip(res, references):
        assert r.token_ids == ref
    ver2 = Verifier(forward, max_tree_tokens=16, kv_block=kv_block)
    ver2.prefill("x", ps[0], SamplingParams(), max_new_tokens=400)
    # room for the prompt, one block and one tree; not for 400 more tokens
    assert ver2.book.slots["x"].cache.capacity == len(ps[0]) + kv_block + 16 + 1
    assert any(c[-1] > c[0] for c in caps.values())             # requests grew as they ran


def test_grown_kv_keeps_the_committed_slots():
    from workers.model.kv_cache import KVCache
    import torch

    c = KVCache(2, 1, 4, 5)
    c.k[:] = torch.arange(40.0).view(2, 1, 5, 4)
    c.v[:] = -c.k
    c.length = 3
    before_k, before_v = c.k[:, :, :3].clone(), c.v[:, :, :3].clone()
    c.grow(12)
    assert c.capacity == 12 and c.length == 3
    assert torch.equal(c.k[:, :, :3], before_k) and torch.equal(c.v[:, :, :3], before_v)
    c.grow(4)                                                   # never shrinks
    assert c.capacity == 12


def test_requests_in_step_grow_their_kv_one_a_step_ahead_of_need(forward):
    """Four requests of equal length, one token a step: without growing ahead they would all
    outgrow their KV in the same step; with it, no step grows more than one, and the output is
    the same as one request's alone."""
    rng = np.random.default_rng(5)
    p = rng.integers(3, 128, size=20).tolist()
    ver = Verifier(forward, max_tree_tokens=16, kv_block=32)
    for i in range(4):
        ver.prefill(f"s{i}", p, SamplingParams(), max_new_tokens=400)
    alone = Verifier(forward, max_tree_tokens=16, kv_block=32)
    alone.prefill("a", p, SamplingParams(), max_new_tokens=400)
    from workers.speculation.tree import TokenTree
    from workers.speculation.verifier import VerifyItem
    outs: dict[str, list[int]] = {f"s{i}": [] for i in range(4)}
    solo, grown = [], []
    for _ in range(150):
        before = [ver.book.slots[r].cache.capacity for r in outs]
        for res in ver.verify([VerifyItem(r, TokenTree.empty()) for r in outs]):
            outs[res.request_id] += res.tokens
            assert res.kv_tokens == ver.book.slots[res.request_id].cache.capacity
        grown.append(sum(ver.book.slots[r].cache.capacity > b for r, b in zip(outs, before)))
        solo += alone.verify([VerifyItem("a", TokenTree.empty())])[0].tokens
    assert max(grown) == 1 and sum(grown) >= 8           # every request grew, one a step
    assert all(o == solo for o in outs.values())


@pytest.mark.parametrize("max_new", [1, 4, 8])
def test_kv_never_grows_past_what_a_request_can_still_use(forward, max_new):
    """A request holds room for its context, a block of output and a tree; when its whole output
    fits that, no step grows its KV (a grow copies the whole context: deep in a long prompt, the
    step that completed it stalled every stream). Chunked, then decoding to its limit, with the
    largest trees; the output is the whole-prefill one."""
    from workers.speculation.tree import TokenTree
    from workers.speculation.verifier import VerifyItem

    rng = np.random.default_rng(7)
    p = rng.integers(3, 128, size=60).tolist()
    whole = Verifier(forward, max_tree_tokens=16, kv_block=8)
    whole.prefill("w", p, SamplingParams(), max_new_tokens=max_new)
    ver = Verifier(forward, max_tree_tokens=16, kv_block=8)
    ver.prefill("c", p, SamplingParams(), max_new_tokens=max_new, defer=True)
    held = ver.book.slots["c"].cache.capacity
    out, ref = [], []
    while len(out) < max_new:
        pending = ver.pending("c")
        (res,) = ver.verify([VerifyItem("c", TokenTree.empty(), min(pending, 7))])
        out += res.tokens
        assert ver.book.slots["c"].cache.capacity == held
    while len(ref) < max_new:
        ref += whole.verify([VerifyItem("w", TokenTree.empty())])[0].tokens
    assert out[:max_new] == ref[:max_new]
    # a request that may write more than it holds still grows (the bound is its own, not none)
    big = Verifier(forward, max_tree_tokens=16, kv_block=8)
    big.prefill("g", p, SamplingParams(), max_new_tokens=64)
    start = big.book.slots["g"].cache.capacity
    for _ in range(40):
        big.verify([VerifyItem("g", TokenTree.empty())])
    assert start < big.book.slots["g"].cache.capacity <= len(p) + 64 + 16 + 1
