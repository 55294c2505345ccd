"""The linears' weight layouts: each agrees with F.linear for any row count; the choice per machine."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import workers.model.cpu_linear as cl
from workers.model.cpu_linear import Linear, pick_backend

CPU = torch.device("cpu")
USABLE = cl._usable_backends(CPU, torch.float32)


@pytest.mark.parametrize("backend", USABLE)
@pytest.mark.parametrize("with_bias", [False, True])
def test_every_layout_matches_f_linear_for_any_row_count(backend, with_bias):
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 40, generator=g)                     # [out, in]
    bias = torch.randn(96, generator=g) if with_bias else None
    lin = Linear(weight, bias, backend)
    for rows in (1, 2, 3, 4, 5, 8, 9, 16, 17, 31, 32, 33, 100):   # in, between and past the MKL buckets
        x = torch.randn(rows, 40, generator=g)
        y = lin(x)
        assert y.shape == (rows, 96)
        assert torch.allclose(y, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5), (backend, rows)


def test_onednn_layout_replaces_the_plain_weight():
    if "onednn" not in USABLE:
        pytest.skip("no oneDNN in this torch build")
    lin = Linear(torch.randn(8, 4), None, "onednn")
    assert lin.weight is None and lin.mkl == {} and lin.small is None   # one copy, not two


def test_override_and_environment_choose_the_backend(monkeypatch):
    for backend in USABLE:
        assert pick_backend(CPU, torch.float32, backend) == backend
        monkeypatch.setenv("SPECGATE_CPU_GEMM", backend)
        assert pick_backend(CPU, torch.float32) == backend
    monkeypatch.setenv("SPECGATE_CPU_GEMM", "fastest")
    with pytest.raises(ValueError, match="SPECGATE_CPU_GEMM"):
        pick_backend(CPU, torch.float32)


def test_auto_takes_our_kernel_where_it_builds_else_follows_the_cpu_vendor(monkeypatch):
    monkeypatch.delenv("SPECGATE_CPU_GEMM", raising=False)
    for vendor in ("GenuineIntel", "AuthenticAMD"):
        monkeypatch.setattr(cl, "_cpu_vendor", lambda: vendor)
        if "small" in USABLE:
            assert pick_backend(CPU, torch.float32) == "small"
    monkeypatch.setattr(cl, "_usable_backends", lambda device, dtype: ("plain", "mkl", "onednn"))
    monkeypatch.setattr(cl, "_cpu_vendor", lambda: "GenuineIntel")
    assert pick_backend(CPU, torch.float32) == "mkl"
    assert pick_backend(CPU, torch.bfloat16) == "onednn"
    monkeypatch.setattr(cl, "_cpu_vendor", lambda: "AuthenticAMD")
    assert pick_backend(CPU, torch.float32) == "onednn"


@pytest.mark.parametrize("vendor, many_rows", [("GenuineIntel", "plain"), ("AuthenticAMD", "onednn")])
def test_small_sends_many_rows_to_the_copy_fast_on_this_vendor(monkeypatch, vendor, many_rows):
    if not {"small", "onednn"} <= set(USABLE):
        pytest.skip("needs our kernel and oneDNN")
    monkeypatch.setattr(cl, "_cpu_vendor", lambda: vendor)
    g = torch.Generator().manual_seed(2)
    weight, bias = torch.randn(96, 40, generator=g), torch.randn(96, generator=g)
    lin = Linear(weight, bias, "small")
    assert (lin.onednn is not None, lin.weight is not None) == (many_rows == "onednn", many_rows == "plain")
    for rows in (3, lin.small_max_rows + 1, 200):
        x = torch.randn(rows, 40, generator=g)
        assert torch.allclose(lin(x), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5), rows


def test_layouts_that_cannot_serve_fall_back_to_plain():
    # Other devices have their own BLAS.
    assert pick_backend(CPU, torch.bfloat16, "mkl") == "plain"   # MKL packs float32 only
    assert pick_backend(CPU, torch.float16, "onednn") == "plain"
    assert pick_backend(torch.device("meta"), torch.float32, "onednn") == "plain"
    with pytest.raises(ValueError, match="unknown GEMM backend"):
        Linear(torch.randn(2, 2), None, "blas")


@pytest.mark.parametrize("backend", cl._usable_backends(CPU, torch.bfloat16))
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_layouts_match_f_linear(backend, with_bias):
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(96, 40, generator=g).to(torch.bfloat16)
    bias = torch.randn(96, generator=g).to(torch.bfloat16) if with_bias else None
    lin = Linear(weight, bias, backend)
    for rows in (1, 2, 6, 7, 16, 33):       # either side of `small`'s switch to oneDNN
        x = torch.randn(rows, 40, generator=g).to(torch.bfloat16)
        assert torch.allclose(lin(x).float(), F.linear(x, weight, bias).float(), rtol=2e-2, atol=2e-2), (backend, rows)


def test_bf16_keeps_plain_where_onednn_cannot_pack_bf16(monkeypatch):
    # An AVX2-only CPU: oneDNN serves float32 but its bf16 reorder raises, so bf16 must not pick it.
    if not cl._has_onednn():
        pytest.skip("no oneDNN in this torch build")
    monkeypatch.setattr(cl, "_onednn_has_bf16", lambda: False)
    assert "onednn" not in cl._usable_backends(CPU, torch.bfloat16)
    assert "onednn" in cl._usable_backends(CPU, torch.float32)
    assert pick_backend(CPU, torch.bfloat16, "onednn") == "plain"
