"""Chunked prefill in the verifier: a prompt's KV computed a chunk per step, in the same pass as
other requests' trees, gives the same hidden states and the same output as a whole prefill."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers import hf_greedy
from workers.contract import SamplingParams
from workers.model.llama_forward import LlamaForward
from workers.model.prefix_cache import PrefixCache
from workers.speculation.tree import TokenTree
from workers.speculation.verifier import Verifier, VerifyItem

EOS = 2
GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def forward(tiny_model):
    return LlamaForward(tiny_model)


def prompt(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(3, 128, size=n).tolist()


def decode(v: Verifier, rid: str, n: int, chunk: int, others: list[str] = (),
           tree=TokenTree.empty()) -> tuple[list[int], list]:
    """Step `rid` (chunks of `chunk` until its context is complete) beside `others` (plain
    steps), until it has n tokens. Returns its tokens and every features tuple it reported."""
    tokens, features = [], []
    while len(tokens) < n:
        items = [VerifyItem(rid, tree, prefill=chunk)] + [VerifyItem(o, TokenTree.empty()) for o in others]
        res = v.verify(items)[0]
        assert res.prefilled <= chunk
        tokens += res.tokens
        if res.features is not None:
            features.append(res.features)
    return tokens[:n], features


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_chunked_prefill_gives_the_whole_prefills_output_and_hidden_states(tiny_model, forward, chunk):
    p = prompt(150)
    ref = hf_greedy(tiny_model, p, 12, eos=None)
    whole = Verifier(forward, features=True)
    whole.prefill("w", p, GREEDY, 12)
    want, want_f = decode(whole, "w", 12, 0)
    chunked = Verifier(forward, features=True)
    got = chunked.prefill("c", p, GREEDY, 12, defer=True)
    assert got.pending == len(p) - 1 and got.features is None
    tokens, feats = decode(chunked, "c", 12, chunk)
    assert want == ref[:12] and tokens == want
    # the first decoded step reads the same hidden state (so the same logits) at the root
    np.testing.assert_allclose(feats[0], want_f[0], atol=1e-5)


def test_chunks_ride_along_with_other_requests_trees_without_changing_them(tiny_model, forward):
    """A long prompt prefilled in chunks inside steps of two running requests: all three
    outputs equal plain greedy decoding, and the running requests get a token every step."""
    ps = [prompt(40, 1), prompt(25, 2), prompt(300, 3)]
    refs = [hf_greedy(tiny_model, q, 16, eos=None) for q in ps]
    v = Verifier(forward)
    v.prefill("a", ps[0], GREEDY, 16)
    v.prefill("b", ps[1], GREEDY, 16)
    v.prefill("long", ps[2], GREEDY, 16, defer=True)
    out = {"a": [], "b": [], "long": []}
    steps = 0
    while len(out["long"]) < 16:
        items = [VerifyItem("long", TokenTree.empty(), prefill=32)]
        items += [VerifyItem(r, TokenTree.empty()) for r in ("a", "b") if len(out[r]) < 16]
        for res in v.verify(items):
            out[res.request_id] += res.tokens
            if res.request_id != "long":
                assert len(res.tokens) == 1          # never stalled by the prefill
        steps += 1
    assert steps >= 299 // 32 + 16 - 1              # the prompt took ceil(299 / 32) chunks
    for rid, ref in zip(("a", "b", "long"), refs):
        assert out[rid][:16] == ref[:16]


def test_a_chunk_that_completes_the_context_verifies_a_tree_in_the_same_pass(tiny_model, forward):
    p = prompt(30, 4)
    ref = hf_greedy(tiny_model, p, 8, eos=None)
    v = Verifier(forward)
    v.prefill("r", p, GREEDY, 8, defer=True)
    (first,) = v.verify([VerifyItem("r", TokenTree.empty(), prefill=20)])
    assert first.tokens == () and first.prefilled == 20 and first.pending == 9 and first.tree_tokens == 0
    chain = TokenTree.chain(ref[:4])                  # the true continuation: all accepted
    (second,) = v.verify([VerifyItem("r", chain, prefill=20)])
    assert second.prefilled == 9 and second.pending == 0
    assert list(second.tokens) == ref[:5] and second.accepted == 4


def test_a_request_prefilled_ahead_of_its_turn_commits_nothing_and_reports_its_features(forward):
    p = prompt(50, 5)
    whole = Verifier(forward, features=True)
    want = whole.prefill("w", p, GREEDY, 4).features
    v = Verifier(forward, features=True)
    v.prefill("r", p, GREEDY, 4, defer=True)
    (a,) = v.verify([VerifyItem("r", TokenTree.empty(), prefill=30, decode=False)])
    (b,) = v.verify([VerifyItem("r", TokenTree.empty(), prefill=30, decode=False)])
    assert a.tokens == b.tokens == () and a.features is None and b.pending == 0
    np.testing.assert_allclose(b.features, want, atol=1e-5)
    (c,) = v.verify([VerifyItem("r", TokenTree.empty())])           # now its first token
    (w,) = whole.verify([VerifyItem("w", TokenTree.empty())])
    assert c.tokens == w.tokens


@pytest.mark.parametrize("chunk", [5, 16, 64])
def test_chunked_prefill_with_prefix_cache_hits(tiny_model, forward, chunk):
    """The prefix cache still skips whole cached blocks; the rest is chunked; output unchanged,
    and what a chunked prefill computed is stored for the next prompt."""
    shared = prompt(70, 6)
    p1, p2 = shared + prompt(20, 7), shared + prompt(33, 8)
    refs = [hf_greedy(tiny_model, q, 10, eos=None) for q in (p1, p2)]
    v = Verifier(forward, prefix_cache=PrefixCache(64, block=16))
    first = v.prefill("one", p1, GREEDY, 10, defer=True)
    assert first.cached == 0
    assert decode(v, "one", 10, chunk)[0] == refs[0][:10]
    second = v.prefill("two", p2, GREEDY, 10, defer=True)
    assert second.cached == 64 and second.pending == len(p2) - 1 - 64
    assert decode(v, "two", 10, chunk)[0] == refs[1][:10]


def test_sampled_output_is_the_same_with_chunked_prefill(forward):
    p = prompt(90, 9)
    s = SamplingParams(temperature=0.9, top_p=0.95, seed=11)
    outs = []
    for chunk in (0, 13):
        v = Verifier(forward)
        v.prefill("r", p, s, 20, defer=chunk > 0)
        outs.append(decode(v, "r", 20, chunk)[0])
    assert outs[0] == outs[1]


def test_kv_written_by_chunks_equals_a_whole_prefills(forward):
    p = prompt(120, 10)
    whole, chunked = Verifier(forward), Verifier(forward)
    whole.prefill("r", p, GREEDY, 4)
    chunked.prefill("r", p, GREEDY, 4, defer=True)
    while chunked.pending("r"):
        chunked.verify([VerifyItem("r", TokenTree.empty(), prefill=17, decode=False)])
    a, b = whole.book.slots["r"].cache, chunked.book.slots["r"].cache
    assert a.length == b.length == len(p) - 1
    torch.testing.assert_close(a.k[:, :, :a.length], b.k[:, :, :b.length], atol=1e-5, rtol=1e-5)


def test_blocks_computed_mid_prefill_are_in_the_prefix_cache_before_the_prompt_completes(tiny_model, forward):
    """Stored a few blocks a step: a prompt sharing the first chunks' blocks hits them while the
    first prompt is still prefilling, and both outputs are plain greedy."""
    shared = prompt(100, 11)
    p1, p2 = shared + prompt(60, 12), shared[:48] + prompt(10, 13)
    v = Verifier(forward, prefix_cache=PrefixCache(64, block=16))
    v.prefill("one", p1, GREEDY, 6, defer=True)
    for _ in range(2):
        v.verify([VerifyItem("one", TokenTree.empty(), prefill=25, decode=False)])
    assert v.pending("one") == len(p1) - 1 - 50
    second = v.prefill("two", p2, GREEDY, 6, defer=True)
    assert second.cached == 48                          # the 3 whole blocks of 50 computed tokens
    assert decode(v, "two", 6, 64)[0] == hf_greedy(tiny_model, p2, 6, eos=None)
    assert decode(v, "one", 6, 64)[0] == hf_greedy(tiny_model, p1, 6, eos=None)


def test_the_ngram_drafter_indexes_a_chunked_prompt_as_its_chunks_complete(tiny_model, forward):
    """So its first proposal does not index the whole prompt inside one step (~70 ms for 4,000
    tokens); the output stays plain greedy."""
    from workers.batch_worker import BatchWorker
    from workers.contract import NO_SPECULATION, TreeBudget, WorkItem

    p = prompt(300, 14)
    w = BatchWorker(Verifier(forward), default_drafter="ngram")
    w.prefill("r", p, prompt_len=300, sampling=GREEDY, max_new_tokens=6, defer=True)
    w.step([WorkItem("r", NO_SPECULATION, prefill=100)])
    assert len(w.drafter(None)._indexes["r"].tokens) == 300 - (299 - 100)
    w.step([WorkItem("r", NO_SPECULATION, prefill=100)])
    assert len(w.drafter(None)._indexes["r"].tokens) == 201
    out = []
    while len(out) < 6:
        out += w.step([WorkItem("r", TreeBudget(8, 4), prefill=100)])[0].tokens
    assert out[:6] == hf_greedy(tiny_model, p, 6, eos=None)
