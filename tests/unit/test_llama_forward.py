"""The lean forward against transformers (the reference), on a tiny random Llama, float32."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import tiny_llama
from workers.model.cpu_linear import _usable_backends
from workers.model import packed_attention, small_gemm
from workers.model.kv_cache import KVCache
from workers.model.llama_forward import LlamaForward, Segment
from workers.model.packed_attention import chunkable
from workers.speculation.tree import TokenTree, ancestor_mask, depths
from workers.speculation.packed_rows import tree_mask as _tree_mask

ATOL = 1e-4


@pytest.fixture(params=_usable_backends(torch.device("cpu"), torch.float32))
def gemm(request) -> str:
    """Every weight layout this machine can run: each must match transformers."""
    return request.param


@pytest.fixture(params=["kernel", "torch", "padded", "flex"])
def attention(request) -> str:
    """Every attention path: the CPU kernel (where this machine has it), and torch's, one call per
    request or the requests batched (workers/model/batched_attention.py: a GPU's options)."""
    if request.param == "kernel" and not small_gemm.available(torch.float32):
        pytest.skip(f"no CPU kernels here: {small_gemm.unavailable_reason}")
    return request.param


def lean(model, gemm: str, attention: str) -> LlamaForward:
    """attention "kernel": the CPU kernels, every layer in one call where every linear is on the
    few-row kernel (gemm "small"); "torch": torch's rope and attention, the Python layer loop;
    "padded", "flex": that loop with several requests' attention in one call."""
    lf = LlamaForward(model, gemm=gemm)
    assert lf.fused_attention == (small_gemm.available(torch.float32))   # tiny_llama's head_dim is 64
    assert (lf._stack is not None) == (lf.fused_attention and gemm == "small")
    assert lf.attention == "loop"                                        # the default, until a GPU measures
    lf.fused_attention = attention == "kernel"
    if attention != "kernel":
        lf._stack = None
    lf.attention = attention if attention in ("padded", "flex") else "loop"
    return lf


def causal(n: int) -> torch.Tensor:
    return torch.full((n, n), float("-inf")).triu(1)


def prefilled(lf: LlamaForward, context: list[int]):
    """A cache holding `context`'s KV, as the verifier's prefill leaves it."""
    cache = lf.new_cache(256)
    n = len(context)
    lf.forward(torch.tensor(context), torch.arange(n), [Segment(cache, 0, n, causal(n))], None)
    cache.length = n
    return cache


def tree_pass(lf: LlamaForward, cache, root: int, tree: TokenTree) -> torch.Tensor:
    """One verification pass of root + tree; logits for every row ([1 + n, V])."""
    n = cache.length
    ids = torch.tensor([root, *tree.tokens])
    pos = torch.tensor([n] + [n + d for d in depths(tree)])
    return lf.forward(ids, pos, [Segment(cache, 0, len(ids), _tree_mask(tree))], torch.arange(len(ids)))


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0]


def test_full_sequence_matches_transformers(tiny_model, gemm):
    lf = LlamaForward(tiny_model, gemm=gemm)
    ids = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    cache = lf.new_cache(64)
    out = lf.forward(torch.tensor(ids), torch.arange(40), [Segment(cache, 0, 40, causal(40))], torch.arange(40))
    assert torch.allclose(out, hf_logits(tiny_model, ids), atol=ATOL)


@pytest.mark.parametrize("fused", [False, True])
def test_fused_ops_or_not_match_transformers(tiny_model, fused):
    # The fused RMSNorm (+ residual add), SwiGLU, rope and attention kernels where the CPU has
    # them, torch's ops where it has not.
    lf = LlamaForward(tiny_model)
    if fused and not lf.fused:
        pytest.skip("no fused kernels on this machine")
    lf.fused = lf.fused_attention = fused
    ids = torch.randint(0, 128, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    cache = lf.new_cache(64)
    out = lf.forward(torch.tensor(ids), torch.arange(30), [Segment(cache, 0, 30, causal(30))], torch.arange(30))
    assert torch.allclose(out, hf_logits(tiny_model, ids), atol=ATOL)


def test_long_segments_attend_in_blocks_and_still_match_transformers(tiny_model, gemm, attention):
    # 150 rows: blocks of 64, 64 and 22; once from an empty cache (a prefill) and once after 40
    # cached tokens (a prefill that follows a prefix-cache hit).
    lf = lean(tiny_model, gemm, attention)
    ids = torch.randint(0, 128, (190,), generator=torch.Generator().manual_seed(2)).tolist()
    cache = lf.new_cache(256)
    out = lf.forward(torch.tensor(ids[:150]), torch.arange(150), [Segment(cache, 0, 150, causal(150))],
                     torch.arange(150))
    assert torch.allclose(out, hf_logits(tiny_model, ids[:150]), atol=ATOL)
    cache = prefilled(lf, ids[:40])
    out = lf.forward(torch.tensor(ids[40:]), torch.arange(40, 190), [Segment(cache, 0, 150, causal(150))],
                     torch.arange(150))
    assert torch.allclose(out, hf_logits(tiny_model, ids)[40:], atol=ATOL)


@pytest.mark.parametrize("kernel_max_keys", [768, 0])
def test_a_prefill_packed_with_tree_steps_matches_each_alone(tiny_model, gemm, attention, kernel_max_keys,
                                                             monkeypatch):
    # A request joining a batch: its 80-row prefill in the same pass as another request's tree
    # step; with the kernel, the prefill through it (causal: keys up to each row) or, past its
    # key limit, through torch's blocked attention while the tree step stays in the kernel.
    monkeypatch.setitem(packed_attention.KERNEL_MAX_KEYS, torch.float32, kernel_max_keys)
    lf = lean(tiny_model, gemm, attention)
    ids = torch.randint(0, 128, (80,), generator=torch.Generator().manual_seed(5)).tolist()
    context, root = list(range(20, 50)), 7
    tree = TokenTree(tokens=(5, 9, 11), parents=(-1, 0, 0))
    cache = prefilled(lf, context)
    n = cache.length
    step_ids = [root, *tree.tokens]
    segments = [Segment(lf.new_cache(128), 0, 80, causal(80)), Segment(cache, 80, 4, _tree_mask(tree))]
    out = lf.forward(torch.tensor(ids + step_ids), torch.cat([torch.arange(80), torch.tensor([n, n + 1, n + 2, n + 2])]),
                     segments, torch.arange(84))
    assert torch.allclose(out[:80], hf_logits(tiny_model, ids), atol=ATOL)
    assert torch.allclose(out[80], hf_logits(tiny_model, context + [root])[-1], atol=ATOL)
    assert torch.allclose(out[81], hf_logits(tiny_model, context + [root, 5])[-1], atol=ATOL)
    for node in (1, 2):     # two siblings under the first node
        assert torch.allclose(out[81 + node], hf_logits(tiny_model, context + [root, 5, tree.tokens[node]])[-1],
                              atol=ATOL)


def test_only_segments_whose_rows_never_see_later_rows_are_blocked():
    cache = KVCache(1, 1, 4, 256)
    assert chunkable(Segment(cache, 0, 100, causal(100)))
    assert not chunkable(Segment(cache, 0, 64, causal(64)))       # short: one call
    sees_later = causal(100)
    sees_later[10, 90] = 0.0
    assert not chunkable(Segment(cache, 0, 100, sees_later))


def test_qkv_bias_models_match_transformers(gemm):
    model = tiny_llama(3, attention_bias=True)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.bias.normal_(0, 0.5)
            layer.self_attn.k_proj.bias.normal_(0, 0.5)
    lf = LlamaForward(model, gemm=gemm)
    ids = list(range(5, 25))
    out = lf.forward(torch.tensor(ids), torch.arange(20), [Segment(lf.new_cache(32), 0, 20, causal(20))],
                     torch.arange(20))
    assert torch.allclose(out, hf_logits(model, ids), atol=ATOL)


def test_tree_logits_equal_each_branch_alone(tiny_model, gemm, attention):
    """Every tree node's logits equal running context + root + that node's branch alone."""
    lf = lean(tiny_model, gemm, attention)
    context = list(range(10, 40))
    root = 7
    tree = TokenTree(tokens=(5, 9, 11, 6, 13, 17, 19), parents=(-1, 0, 0, -1, 3, 4, 1))
    out = tree_pass(lf, prefilled(lf, context), root, tree)
    mask = ancestor_mask(tree)
    for i in range(len(tree)):
        branch = [tree.tokens[j] for j in range(len(tree)) if mask[i, j]]
        alone = hf_logits(tiny_model, context + [root] + branch)[-1]
        assert torch.allclose(out[i + 1], alone, atol=ATOL), f"node {i}"
    assert torch.allclose(out[0], hf_logits(tiny_model, context + [root])[-1], atol=ATOL)


def test_packed_requests_of_different_lengths_match_alone(tiny_model, gemm, attention):
    lf = lean(tiny_model, gemm, attention)
    contexts = [list(range(3, 20)), list(range(30, 35)), list(range(50, 90))]
    trees = [TokenTree((4, 6, 8), (-1, 0, 0)), TokenTree.empty(), TokenTree.chain([9, 10, 11, 12])]
    segments, ids, pos, start = [], [], [], 0
    for ctx, tree in zip(contexts, trees):
        cache = prefilled(lf, ctx[:-1])
        m = cache.length
        rows = 1 + len(tree)
        segments.append(Segment(cache, start, rows, _tree_mask(tree)))
        ids += [ctx[-1], *tree.tokens]
        pos += [m] + [m + d for d in depths(tree)]
        start += rows
    out = lf.forward(torch.tensor(ids), torch.tensor(pos), segments, torch.arange(start))
    for ctx, tree, seg in zip(contexts, trees, segments):
        assert torch.allclose(out[seg.start], hf_logits(tiny_model, ctx)[-1], atol=ATOL)
        if tree.parents and all(p == i - 1 for i, p in enumerate(tree.parents)):  # a chain: every row
            full = hf_logits(tiny_model, ctx + list(tree.tokens))[len(ctx) - 1:]
            assert torch.allclose(out[seg.start: seg.start + seg.rows], full, atol=ATOL)


def test_commit_keeps_accepted_path_and_drops_the_rest(tiny_model, gemm, attention):
    """After committing a path, the next pass equals a fresh run over the committed sequence."""
    lf = lean(tiny_model, gemm, attention)
    context = list(range(20, 32))
    root = 3
    tree = TokenTree(tokens=(40, 41, 42, 43, 44), parents=(-1, -1, 1, 2, 0))  # path 1 -> 2 -> 3 is "accepted"
    cache = prefilled(lf, context)
    n = cache.length
    tree_pass(lf, cache, root, tree)
    cache.commit(1, [1, 2, 3])
    assert cache.length == n + 4
    bonus = 50
    out = lf.forward(torch.tensor([bonus]), torch.tensor([cache.length]),
                     [Segment(cache, 0, 1, torch.zeros(1, 1))], torch.arange(1))
    expect = hf_logits(tiny_model, context + [root, 41, 42, 43, bonus])[-1]
    assert torch.allclose(out[0], expect, atol=ATOL)


def test_the_one_call_layer_stack_equals_the_python_loop(tiny_model):
    # The same kernels either way: a tree step and a prefill give the same logits and KV.
    stacked = LlamaForward(tiny_model, gemm="small") if "small" in _usable_backends(torch.device("cpu"),
                                                                                    torch.float32) else None
    if stacked is None or stacked._stack is None:
        pytest.skip("no CPU kernels here")
    looped = LlamaForward(tiny_model, gemm="small")
    looped._stack = None
    context, root = list(range(10, 45)), 7
    tree = TokenTree(tokens=(5, 9, 11, 6), parents=(-1, 0, 0, 1))
    caches = [prefilled(lf, context) for lf in (stacked, looped)]
    assert torch.equal(caches[0].k[:, :, :35], caches[1].k[:, :, :35])
    outs = [tree_pass(lf, cache, root, tree) for lf, cache in zip((stacked, looped), caches)]
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(caches[0].k[:, :, :40], caches[1].k[:, :, :40])
    assert torch.allclose(outs[0][0], hf_logits(tiny_model, context + [root])[-1], atol=ATOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_is_torchs_first_index_of_the_largest(dtype, tiny_model):
    lf = LlamaForward(tiny_model)
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(5, 1000, generator=g).to(dtype)
    logits[1, 17] = logits[1, 400] = logits[1, 999] = 50.0         # ties: the first wins
    logits[2, 999] = 60.0                                           # in the ragged last vector
    logits[3] = float("-inf")
    logits[3, 0] = -1e30
    assert lf.argmax(logits) == logits.float().argmax(-1).tolist()
    lf.fused = False
    assert lf.argmax(logits) == logits.float().argmax(-1).tolist()


@pytest.mark.parametrize("kind", ["padded", "flex"])
def test_batched_attention_equals_one_call_per_request_in_a_mixed_pass(tiny_model, kind):
    """One pass of the device-generic forward holding a prefill longer than a batch takes (it
    keeps its own call), two tree steps, a chunk of context followed by its root and tree, and a
    draft-like segment whose past mask hides old slots: the batched segments' logits and KV equal
    one SDPA call per request."""
    from tests.helpers import device_generic
    from workers.model.batched_attention import BATCH_MAX_ROWS
    from workers.speculation.packed_rows import step_mask as _step_mask

    g = torch.Generator().manual_seed(11)
    rand = lambda n: torch.randint(3, 128, (n,), generator=g).tolist()   # noqa: E731
    loop, batched = device_generic(tiny_model), device_generic(tiny_model, attention=kind)
    trees = [TokenTree((4, 6, 8, 9), (-1, 0, 0, 2)), TokenTree.chain([9, 10, 11]), TokenTree((5, 7), (-1, -1))]
    contexts = [rand(30), rand(7), rand(50), rand(20)]
    long_prefill = BATCH_MAX_ROWS + 10
    past = torch.zeros(3, 19)
    past[:, 2:9] = float("-inf")                                        # slots a draft's window hides

    def run(lf):
        caches = [prefilled(lf, ctx) for ctx in contexts] + [lf.new_cache(long_prefill + 8)]
        segs, ids, pos, start = [], [], [], 0
        for cache, tree in zip(caches[:2], trees[:2]):                 # tree steps
            rows = 1 + len(tree)
            segs.append(Segment(cache, start, rows, _tree_mask(tree)))
            ids += [7, *tree.tokens]
            pos += [cache.length] + [cache.length + d for d in depths(tree)]
            start += rows
        c = 5                                                           # a chunk, then root and tree
        segs.append(Segment(caches[2], start, c + 1 + len(trees[2]), _step_mask(c, trees[2])))
        ids += rand(c) + [7, *trees[2].tokens]
        L = caches[2].length
        pos += list(range(L, L + c)) + [L + c] + [L + c + d for d in depths(trees[2])]
        start = len(ids)
        caches[3].length = 19                                           # a draft-like segment
        caches[3].k.normal_(generator=g), caches[3].v.normal_(generator=g)
        segs.append(Segment(caches[3], start, 3, causal(3), past))
        ids += rand(3)
        pos += [40, 41, 42]
        start = len(ids)
        segs.append(Segment(caches[4], start, long_prefill, causal(long_prefill)))
        ids += rand(long_prefill)
        pos += list(range(long_prefill))
        out = lf.forward(torch.tensor(ids), torch.tensor(pos), segs, torch.arange(len(ids)))
        return out, [s.cache.k[:, :, : s.cache.length + s.rows] for s in segs], packed_attention.plan(lf.heads, segs, torch.tensor(pos), lf.fused_attention)

    g.manual_seed(11)
    want, want_keys, plan = run(loop)
    g.manual_seed(11)
    got, got_keys, plan = run(batched)
    assert plan.padded.picked == [0, 1, 2, 3] and plan.long == [4]   # the long prefill keeps its own call
    assert packed_attention.plan(loop.heads, [], torch.zeros(0), loop.fused_attention).padded is None
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(got_keys, want_keys):            # the same KV: layer 0's before any attention
        assert torch.equal(a[0], b[0])
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_the_attention_setting_is_checked_and_read_from_the_environment(tiny_model, monkeypatch):
    from workers.model.batched_attention import resolve_attention

    assert resolve_attention(None, torch.device("cpu")) == "loop"
    monkeypatch.setenv("SPECGATE_ATTENTION", "padded")
    assert LlamaForward(tiny_model).attention == "padded"
    assert LlamaForward(tiny_model, attention="flex").attention == "flex"     # the argument wins
    monkeypatch.setenv("SPECGATE_ATTENTION", "fused")
    with pytest.raises(ValueError, match="attention must be one of"):
        LlamaForward(tiny_model)
