"""Linear layers for the lean forward, with the weight layout that is fastest on this machine.

A verification step multiplies a few rows (pending tokens + tree nodes) by every weight of the
model; on CPU that is memory-bound and dominated by how the GEMM library treats the weight:

- `plain`: `F.linear` (MKL's sgemm on CPU builds, cuBLAS on GPU). MKL re-packs the weight on every
  call, which for few rows costs more than the arithmetic.
- `mkl`: copies pre-packed once per row bucket (4, 8, 16, 32) through `torch.ops.mkl._mkl_linear`,
  which only uses a copy for its exact row count, so inputs are zero-padded up to the next bucket.
  Measured on a 2-core Intel Xeon (AVX-512/AMX), 30 layers' linears, fp32: plain 1-2 rows 16 ms,
  4 rows 28 ms, 8 rows 37 ms, 16 rows 43 ms; packed 4/8/16 rows 20, 25, 29 ms. One or two rows use
  the plain layout, which is as fast there. Price: one extra weight copy per bucket.
- `onednn`: one copy in oneDNN's blocked layout (`torch.ops.mkldnn._reorder_linear_weight`), used
  for any row count. MKL picks slow code paths on non-Intel CPUs; measured on a 2-core AMD EPYC
  (Zen 4, AVX-512), whole SmolLM2-135M forward, fp32, 400 tokens of context: plain 1 row 44 ms,
  2 rows 74 ms, 16 rows 82 ms; oneDNN 25, 28 and 36 ms. It replaces the plain weight, so it costs
  no extra memory. In bf16 (`F.linear` already runs on oneDNN there) the packed copy saves the
  per-call reorder: 1 row 26 -> 18 ms, 16 rows 26 -> 23 ms. The layout is chosen for a batch-size
  hint (`ONEDNN_ROWS_HINT`): a hint of 1 picks a matrix-vector layout that is slower at every row
  count we run; 16 was best or within noise of best for 1-32 rows (SmolLM2's 120 distinct layer
  weights, AMD EPYC, fp32: 1 row 13.7 -> 11.0 ms, 8 rows 18.1 -> 13.3, 16 rows 20.8 -> 15.5, 32 rows
  29.6 -> 25.5; bf16: 1 row 7.1 -> 5.7, 16 rows 10.3 -> 9.7).

- `small`: the weight packed in panels for few rows (workers/small_gemm.py, our own AVX-512
  kernel), streamed once a call; more rows (prefills) go to a second copy: the plain weight in
  float32 on Intel (MKL), oneDNN's blocked layout in bf16 (AMX there) and on other CPUs (where MKL
  is slow: a 512-token fp32 prefill of SmolLM2 on a 2-core AMD EPYC Zen 5, 659 ms through MKL,
  319 ms through oneDNN). Measured on the 2-core Intel Xeon,
  the 120 layer weights, fp32 (this machine's memory gives 18-24 GB/s and every figure moves with
  it, so these are runs side by side): 1 row 15.4 ms (F.linear 18.9), 8 rows 24.7 (MKL packed for
  8: 23.1), 16 rows 25.1 (MKL packed: 30.1), 32 rows 40.4 (45.7); 64 rows 60.9 against F.linear's
  79.4; past ~100 rows MKL and oneDNN win. In bf16 with AMX, its tile kernel streams the weights
  at the memory's speed up to 16-32 rows (120 weights: 1 row 8.0 ms against oneDNN's 11.6, 16
  rows 8.6 against 13.2, 32 rows 11.4 against 14.8; 64 rows mixed), so up to 32 rows go to it;
  without AMX its AVX-512 BF16 dot products win only for a few rows (1 row 11.9 vs 19.9 ms, 8 rows
  even, 16 rows 32 vs 18), so more than 6 go to oneDNN. Two copies of the weights, against MKL's
  five (plain + four buckets). Whole SmolLM2 forward, 400 tokens of context, runs interleaved:
  1 row 34.5 ms (MKL 36.2), 8 rows 56.1 (51.2), 16 rows 58.5 (66.3), 32 rows 76.5 (91.4).
  On the 2-core AMD EPYC (Zen 5, 2026-12-02), whole SmolLM2 forward, 128 tokens of context, runs
  interleaved, `small` against `onednn`: fp32 1 row 12.9 ms (16.4), 8 rows 16.7 (18.6), 16 rows
  19.7 (22.5), 32 rows 28.2 (34.1), 64 rows 53.1 (57.1); bf16 1 row 7.5 (10.3), 8-64 rows within
  noise (both run oneDNN there). So `small` is the choice wherever it builds.

`pick_backend` chooses per machine; `SPECGATE_CPU_GEMM=plain|mkl|onednn|small` overrides it (benchmarks
compare them side by side). Results agree with `F.linear` to float32 rounding (~1e-5 relative),
not bit for bit: different kernels sum in different orders.
"""
from __future__ import annotations

import os
from functools import lru_cache

import torch
import torch.nn.functional as F

from workers import small_gemm

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
        # Our few-row kernel was measured fastest on Intel and on AMD (above); without it, MKL's
        # packed copies on Intel, oneDNN elsewhere (MKL is slow on AMD).
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
