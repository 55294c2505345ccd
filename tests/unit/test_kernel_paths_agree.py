"""The kernel paths compute the same numbers where they run the same arithmetic (one source,
csrc/simd.h's layer per width): every float32 op on every path, the whole float32 forward on the
two AVX-512 paths (BF16 and AMX serve bf16 alone), and every bf16 op on the paths without BF16 dot
products (avx512f and avx2 both widen bf16 by shifts and multiply-add in float32). So a model
decodes on the avx512f path exactly as on the path it stands in for. Bit for bit, not to a
tolerance: a difference here is a path computing something else."""
from __future__ import annotations

import copy

import pytest
import torch

from tests.kernel_paths import use_kernel_path
from workers.model import small_gemm
from workers.model.llama_forward import LlamaForward, Segment

pytestmark = pytest.mark.skipif(not small_gemm.available(torch.float32),
                                reason=f"small_gemm unavailable: {small_gemm.unavailable_reason}")


def _module(name: str):
    why = small_gemm.path_unsupported(name)
    if why is not None:
        pytest.skip(f"{name} kernel path: {why}")
    return small_gemm.load_path(name)


def _ops(mod, dtype: torch.dtype) -> list[torch.Tensor]:
    """Each op of the module on the same inputs: linears (ragged panel, odd K, 1-40 rows, with the
    blocks' k chunks), RMSNorm with the residual add, SwiGLU, argmax."""
    g = torch.Generator().manual_seed(11)
    w = torch.randn(130, 201, generator=g).to(dtype)
    bias = torch.randn(130, generator=g)
    packed = small_gemm.pack(w)        # an odd K: never AMX tiles, which one path alone runs
    out = [mod.linear(torch.randn(rows, 201, generator=g).to(dtype), packed, 130, bias) for rows in (1, 5, 13, 40)]
    x = torch.randn(7, 576, generator=g).to(dtype)
    delta, weight = torch.randn(7, 576, generator=g).to(dtype), torch.randn(576, generator=g).to(dtype)
    out.append(mod.rms_norm(x, delta, weight, 1e-5))
    out.append(x)                                            # the residual add, in place
    out.append(mod.silu_mul((torch.randn(7, 80, generator=g) * 6).to(dtype)))
    out.append(mod.argmax_rows(torch.randn(6, 1000, generator=g).to(dtype)))
    return out


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[int]:
    return [i for i, (x, y) in enumerate(zip(a, b)) if not torch.equal(x, y)]


@pytest.mark.parametrize("name", [p for p in small_gemm.PATHS if p != "avx2"])
def test_float32_ops_are_the_same_bits_on_every_path(name):
    ops = _ops(_module(name), torch.float32)
    assert _same(ops, _ops(_module("avx2"), torch.float32)) == []


def test_bf16_ops_on_avx512f_are_the_avx2_paths_bits():
    ops = _ops(_module("avx512f"), torch.bfloat16)
    assert _same(ops, _ops(_module("avx2"), torch.bfloat16)) == []


def _logits(name: str, model, monkeypatch) -> torch.Tensor:
    """A prefill of 40 tokens, then a tree of 5 over it (the step's kernels: rope, KV write, tree
    attention, the one-call layer stack), on kernel path `name`: the tree's logits."""
    use_kernel_path(name, monkeypatch)
    lf = LlamaForward(model)
    assert lf.fused_attention and lf._stack is not None
    ids = torch.randint(0, 128, (45,), generator=torch.Generator().manual_seed(2))
    cache = lf.new_cache(64)
    lf.forward(ids[:40], torch.arange(40), [Segment(cache, 0, 40, torch.full((40, 40), float("-inf")).triu(1))], None)
    cache.length = 40
    tree = torch.full((5, 5), float("-inf"))
    for row, parents in enumerate([[0], [0, 1], [0, 1, 2], [3], [3, 4]]):   # two branches
        tree[row, parents] = 0.0
    pos = torch.tensor([40, 41, 42, 41, 42])
    return lf.forward(ids[40:], pos, [Segment(cache, 0, 5, tree)], torch.arange(5))


def test_the_float32_forward_on_avx512f_is_the_avx512_bf16_paths_bit_for_bit(tiny_model, monkeypatch):
    wide = _logits("avx512_bf16", copy.deepcopy(tiny_model), monkeypatch)
    assert torch.equal(_logits("avx512f", copy.deepcopy(tiny_model), monkeypatch), wide)
