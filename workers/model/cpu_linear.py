"""Linear layers for the lean forward, with the weight layout that is fastest on this machine.

A verification step multiplies a few rows (pending tokens + tree nodes) by every weight of the
model; on CPU that is memory-bound and dominated by how the GEMM library treats the weight:

- `plain`: `F.linear` (MKL's sgemm on CPU builds, cuBLAS on GPU). MKL re-packs the weight on every
  call, which for few rows costs more than the arithmetic.
- `mkl`: copies pre-packed once per row bucket (4, 8, 16, 32) through `torch.ops.mkl._mkl_linear`,
  which only uses a copy for its exact row count, so inputs are zero-padded up to the next bucket.
  On a 2-core Intel Xeon (AVX-512/AMX) the packed copies beat the plain weight from 4 rows up;
  one or two rows use the plain layout, which is as fast there. Price: one extra weight copy per
  bucket.
- `onednn`: one copy in oneDNN's blocked layout (`torch.ops.mkldnn._reorder_linear_weight`), used
  for any row count. MKL picks slow code paths on non-Intel CPUs: on a 2-core AMD EPYC (Zen 4,
  AVX-512) the whole forward ran far faster through oneDNN at every row count. It replaces the
  plain weight, so it costs no extra memory. In bf16 (`F.linear` already runs on oneDNN there)
  the packed copy saves the per-call reorder. The layout is chosen for a batch-size hint
  (`ONEDNN_ROWS_HINT`): a hint of 1 picks a matrix-vector layout that is slower at every row
  count we run; 16 was best or within noise of best for 1-32 rows, in fp32 and bf16.

- `small`: the weight packed in panels for few rows (workers/model/small_gemm.py, our own AVX-512
  kernel), streamed once a call; more rows (prefills) go to a second copy: the plain weight in
  float32 on Intel (MKL), oneDNN's blocked layout in bf16 (AMX there) and on other CPUs (where MKL
  is slow: an fp32 prefill through MKL took about twice as long as through oneDNN on a Zen 5).
  On the Intel Xeon, fp32, `small` beat F.linear at every row count up to 64 and MKL's packed
  copies at 1, 16 and 32 rows (MKL's copy for 8 rows was a little faster); past ~100 rows MKL
  and oneDNN win. In bf16 with AMX, its tile kernel streams the weights at the memory's speed up to
  16-32 rows, so up to 32 rows go to it; without AMX its AVX-512 BF16 dot products win only for a
  few rows, so more than 6 go to oneDNN. Two copies of the weights, against MKL's five (plain +
  four buckets). On the AMD EPYC (Zen 5) `small` beats `onednn` over the whole forward in fp32
  from 1 to 64 rows, and in bf16 at 1 row (8-64 rows within noise: both run oneDNN there). So
  `small` is the choice wherever it builds.

Every comparison above was run side by side on one machine (these VMs' memory speed moves every
figure); the figures, with machines and dates, are in README.md, "CPU kernels and weight layouts".

`pick_backend` chooses per machine; `SPECGATE_CPU_GEMM=plain|mkl|onednn|small` overrides it (benchmarks
compare them side by side). Results agree with `F.linear` to float32 rounding (~1e-5 relative),
not bit for bit: different kernels sum in different orders.
"""
from __future__ import annotations

import os
from functools import lru_cache

import torch
import torch.nn.functional as F

from workers.model import small_gemm

BACKENDS = ("plain", "mkl", "onednn", "small")
MKL_BUCKETS = (4, 8, 16, 32)
ONEDNN_ROWS_HINT = 16   # the row count oneDNN's blocked weight layout is tuned for (see above)


def pick_backend(device: torch.device, dtype: torch.dtype, override: str | None = None) -> str:
    """The GEMM path for the lean forward's linears on `device`/`dtype`.

    `override` (or SPECGATE_CPU_GEMM) names one of BACKENDS; a backend that cannot serve this
    device/dtype falls back to `plain`, so a setting made for one machine never breaks another.
    """
    choice = override or os.environ.get("SPECGATE_CPU_GEMM", "") or "auto"
    if choice not in BACKENDS + ("auto",):
        raise ValueError(f"SPECGATE_CPU_GEMM must be one of {', '.join(BACKENDS + ('auto',))}, not {choice!r}")
    usable = _usable_backends(device, dtype)
    if choice == "auto":
        # Our few-row kernel was measured fastest on Intel and on AMD (above; README.md, "CPU
        # kernels and weight layouts"); without it, MKL's packed copies on Intel, oneDNN elsewhere
        # (MKL is slow on AMD).
        if "small" in usable:
            choice = "small"
        elif _cpu_vendor() == "GenuineIntel":
            choice = "mkl" if dtype == torch.float32 else "onednn"
        else:
            choice = "onednn"
    return choice if choice in usable else "plain"


def _usable_backends(device: torch.device, dtype: torch.dtype) -> tuple[str, ...]:
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return ("plain",)   # GPUs have cuBLAS
    usable = ["plain"]
    if dtype == torch.float32 and torch._C.has_mkl and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight"):
        usable.append("mkl")
    if _has_onednn() and (dtype == torch.float32 or _onednn_has_bf16()):
        usable.append("onednn")
    if small_gemm.available(dtype, device) and (dtype == torch.float32 or "onednn" in usable):
        usable.append("small")
    return tuple(usable)


def _has_onednn() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


@lru_cache(maxsize=1)
def _onednn_has_bf16() -> bool:
    # oneDNN packs bf16 weights only on CPUs with AVX-512 BW/VL/DQ or AVX-NE-CONVERT; on an
    # AVX2-only CPU its reorder raises, so bf16 stays on F.linear (plain) there.
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


@lru_cache(maxsize=1)
def _cpu_vendor() -> str:
    return small_gemm.cpuinfo_field("vendor_id")


class Linear:
    """y = x W^T (+ b) for a packed-rows input x: [M, in] -> [M, out], on the chosen backend."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, backend: str = "plain"):
        if backend not in BACKENDS:
            raise ValueError(f"unknown GEMM backend {backend!r}")
        self.backend = backend
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else bias.detach().contiguous()
        weight = weight.detach().contiguous()                               # [out, in]
        # `small` keeps a second copy for many rows: plain in float32 on Intel (MKL), else oneDNN's.
        self.small = small_gemm.pack(weight) if backend == "small" else None
        # the kernel adds a float32 bias: converted once here, not on every call
        self.small_bias = None if self.small is None or bias is None else self.bias.float()
        # up to this many rows `small` runs its own kernel; more go to its second copy
        self.small_max_rows = 0 if self.small is None else small_gemm.max_rows(self.small)
        # (a torch built without oneDNN keeps the plain float32 copy wherever it runs)
        blocked = backend == "onednn" or (backend == "small" and (
            weight.dtype == torch.bfloat16 or (_cpu_vendor() != "GenuineIntel" and _has_onednn())))
        self.weight = None if blocked else weight
        self.onednn = torch.ops.mkldnn._reorder_linear_weight(weight, ONEDNN_ROWS_HINT) if blocked else None
        self.mkl = ({rows: torch.ops.mkl._mkl_reorder_linear_weight(weight, rows) for rows in MKL_BUCKETS}
                    if backend == "mkl" else {})
        # rows 0..32 -> the MKL bucket that serves them (None: the plain layout, as fast for 1-2 rows)
        self._bucket = [next((b for b in MKL_BUCKETS if b >= m), None) if m >= 3 and self.mkl else None
                        for m in range(MKL_BUCKETS[-1] + 1)]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.small is not None and x.shape[0] <= self.small_max_rows:
            return small_gemm.linear(x, self.small, self.out_features, self.small_bias)
        if self.onednn is not None:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.onednn, self.bias, "none", [], "")
        m = x.shape[0]
        rows = self._bucket[m] if m < len(self._bucket) else None
        if rows is None:
            return F.linear(x, self.weight, self.bias)
        if m < rows:
            x = torch.cat([x, x.new_zeros(rows - m, x.shape[1])])            # [rows, in]
        y = torch.ops.mkl._mkl_linear(x.contiguous(), self.mkl[rows], self.weight, self.bias, rows)
        return y[:m]
