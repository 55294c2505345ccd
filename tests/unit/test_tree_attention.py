"""The step's attention kernels (workers/model/csrc/attention.cpp) against torch's ops: rope + KV write
for several requests at once, and tree attention with tree masks, past masks, grouped heads, row
counts across the 16-row tasks, every head dim it is built for, float32 and bf16 outputs."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tests.kernel_paths import kernel_path  # noqa: F401  (the fixture: every kernel path)
from workers.model import small_gemm

DTYPES = [dt for dt in (torch.float32, torch.bfloat16) if small_gemm.available(dt)]
pytestmark = [pytest.mark.skipif(not DTYPES, reason=f"small_gemm unavailable: {small_gemm.unavailable_reason}"),
              pytest.mark.usefixtures("kernel_path")]
NINF = float("-inf")


def _caches(n_layers, nkv, cap, D, g, kv_dtype=torch.float32):
    return tuple(torch.randn(n_layers, nkv, cap, D, generator=g).to(kv_dtype) for _ in "kv")


# (model dtype, KV dtype): the lean forward's float32 and bf16 modes (bf16 KV where the kernel
# runs), and bf16 weights over a float32 KV
MODES = [(dt, kv) for dt, kv in ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                 (torch.bfloat16, torch.float32)) if dt in DTYPES]


@pytest.mark.parametrize("dtype,kv_dtype", MODES)
@pytest.mark.parametrize("D", small_gemm.ATTENTION_HEAD_DIMS)
def test_rope_store_writes_every_requests_kv_and_returns_the_queries(dtype, kv_dtype, D):
    g = torch.Generator().manual_seed(4)
    nq, nkv, cap, layer = 6, 2, 20, 1
    rows, lengths = [3, 1, 5], [4, 0, 15]
    starts = [0, 3, 4]
    T = sum(rows)
    qkv = torch.randn(T, (nq + 2 * nkv) * D, generator=g).to(dtype)
    cos = torch.randn(T, D, generator=g).to(dtype)
    sin = torch.randn(T, D, generator=g).to(dtype)
    caches = [_caches(3, nkv, cap, D, g, kv_dtype) for _ in rows]
    before = [(k.clone(), v.clone()) for k, v in caches]
    q = small_gemm.rope_store(qkv, cos, sin, [k for k, _ in caches], [v for _, v in caches], layer,
                              starts, rows, lengths, nq, nkv)

    # the lean forward's torch path: rope by roll with a pre-signed sine, in the model's dtype
    heads = qkv.view(T, nq + 2 * nkv, D)
    qk = heads[:, : nq + nkv]
    qk = qk * cos[:, None] + qk.roll(D // 2, -1) * sin[:, None]
    assert q.shape == (T, nq, D) and q.dtype == torch.float32
    torch.testing.assert_close(q, qk[:, :nq].float(), rtol=2e-6, atol=2e-6)
    for (k, v), (k0, v0), lo, n, at in zip(caches, before, starts, rows, lengths):
        torch.testing.assert_close(k[layer, :, at: at + n], qk[lo: lo + n, nq:].to(kv_dtype).transpose(0, 1),
                                   rtol=2e-6, atol=2e-6)
        assert torch.equal(v[layer, :, at: at + n], heads[lo: lo + n, nq + nkv:].to(kv_dtype).transpose(0, 1))
        k[layer, :, at: at + n] = k0[layer, :, at: at + n]         # nothing else may have changed
        v[layer, :, at: at + n] = v0[layer, :, at: at + n]
        assert torch.equal(k, k0) and torch.equal(v, v0)
    with pytest.raises(RuntimeError, match="capacity"):
        small_gemm.rope_store(qkv, cos, sin, [k for k, _ in caches], [v for _, v in caches], layer,
                              starts, rows, [4, 0, cap - 2], nq, nkv)


def _reference(q, k, v, layer, start, rows, length, mask, past, nq):
    """torch's attention of one request's rows: [rows, Hq, D] float32."""
    end = length + rows
    full = torch.cat([torch.zeros(rows, length) if past is None else past, mask], dim=1)   # [rows, end]
    out = F.scaled_dot_product_attention(q[start: start + rows].transpose(0, 1)[None],
                                         k[layer, :, :end][None], v[layer, :, :end][None],
                                         attn_mask=full, enable_gqa=True)
    return out[0].transpose(0, 1)


def _tree_mask(rows, g):
    """A random tree over the rows in topological order: each row sees its ancestors and itself."""
    parent = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, rows)]
    mask = torch.full((rows, rows), NINF)
    for i in range(rows):
        j = i
        while j >= 0:
            mask[i, j] = 0.0
            j = parent[j]
    return mask


@pytest.mark.parametrize("dtype,kv_dtype", MODES)
@pytest.mark.parametrize("D", small_gemm.ATTENTION_HEAD_DIMS)
def test_tree_attention_matches_torch_for_each_request(dtype, kv_dtype, D):
    g = torch.Generator().manual_seed(D)
    nq, nkv, layer = 9, 3, 1                           # SmolLM2's grouping: 3 query heads a kv head
    rows = [1, 16, 6, 40, 3]                           # folded: 3, 48, 18, 120, 9 query rows
    lengths = [0, 37, 300, 5, 20]
    starts = [sum(rows[:i]) for i in range(len(rows))]
    T = sum(rows)
    q = torch.randn(T, nq, D, generator=g)
    caches = [_caches(2, nkv, L + n + 3, D, g, kv_dtype) for L, n in zip(lengths, rows)]
    masks = [_tree_mask(n, g) for n in rows]
    # one request with a past mask (a draft's sliding window: old slots hidden)
    pasts = [None, None, None, None, torch.where(torch.arange(20) < 12, NINF, 0.0).expand(3, 20).contiguous()]
    out = small_gemm.tree_attention(q, [k for k, _ in caches], [v for _, v in caches], layer, starts, rows,
                                    lengths, masks, pasts, dtype)
    assert out.shape == (T, nq * D) and out.dtype == dtype
    for (k, v), lo, n, L, mask, past in zip(caches, starts, rows, lengths, masks, pasts):
        ref = _reference(q, k.float(), v.float(), layer, lo, n, L, mask, past, nq).reshape(n, nq * D)
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=8e-3, atol=8e-3)
        torch.testing.assert_close(out[lo: lo + n].float(), ref.to(dtype).float(), **tol)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_tree_attention_a_row_that_sees_nothing_gets_zeros_and_sizes_are_checked(kv_dtype):
    D, nq, nkv = 64, 2, 1
    k, v = torch.randn(1, nkv, 8, D).to(kv_dtype), torch.randn(1, nkv, 8, D).to(kv_dtype)
    q = torch.randn(2, nq, D)
    mask = torch.tensor([[NINF, NINF], [0.0, 0.0]])
    past = torch.full((2, 3), NINF)
    out = small_gemm.tree_attention(q, [k], [v], 0, [0], [2], [3], [mask], [past], torch.float32)
    assert torch.equal(out[0], torch.zeros(nq * D))
    # the second row sees both new rows, weighted by softmax of their scores
    s = (q[1] @ k[0, 0, 3:5].float().T) / math.sqrt(D)                 # [nq, 2]
    torch.testing.assert_close(out[1].view(nq, D), s.softmax(-1) @ v[0, 0, 3:5].float(), rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="all float32 or all bf16"):
        small_gemm.tree_attention(q, [k, k.float() if kv_dtype == torch.bfloat16 else k.bfloat16()], [v, v], 0,
                                  [0, 0], [1, 1], [3, 3], [mask[:1, :1]] * 2, [None] * 2, torch.float32)
    with pytest.raises(RuntimeError, match="capacity"):
        small_gemm.tree_attention(q, [k], [v], 0, [0], [2], [7], [mask], [None], torch.float32)
    with pytest.raises(RuntimeError, match="mask"):
        small_gemm.tree_attention(q, [k], [v], 0, [0], [2], [3], [mask[:1]], [None], torch.float32)
    with pytest.raises(RuntimeError, match="head_dim"):                 # 48: no template for it
        small_gemm.tree_attention(torch.randn(2, nq, 48), [k[..., :48].contiguous()], [v[..., :48].contiguous()],
                                  0, [0], [2], [3], [mask], [None], torch.float32)


@pytest.mark.parametrize("length", [0, 30])
def test_a_causal_segment_reads_only_the_keys_up_to_each_row(length):
    # A prefill (after `length` cached tokens): marked causal, each block of rows stops at its own
    # last row's key. The last slot's value set to inf: a block that read it would turn NaN
    # (weighed 0, 0 * inf), so the first block of rows (rows 0-15 of the first head) stays finite.
    g = torch.Generator().manual_seed(length)
    nq, nkv, D, rows = 6, 2, 64, 70
    k, v = _caches(1, nkv, length + rows + 4, D, g)
    q = torch.randn(rows, nq, D, generator=g)
    mask = torch.full((rows, rows), NINF).triu(1)
    ref = _reference(q, k, v, 0, 0, rows, length, mask, None, nq).reshape(rows, nq * D)
    out = small_gemm.tree_attention(q, [k], [v], 0, [0], [rows], [length], [mask], [None], torch.float32, [True])
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    v[0, :, length + rows - 1] = float("inf")
    out = small_gemm.tree_attention(q, [k], [v], 0, [0], [rows], [length], [mask], [None], torch.float32, [True])
    assert torch.isfinite(out[:16, :D]).all() and torch.isinf(out[rows - 1]).any()
    out = small_gemm.tree_attention(q, [k], [v], 0, [0], [rows], [length], [mask], [None], torch.float32, [False])
    assert torch.isnan(out[:16, :D]).all()              # not marked causal: every row reads every key
