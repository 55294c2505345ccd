"""CPU kernels for verification steps: a few-row linear with the weight packed in panels and
streamed once a call, and fused versions of the small ops between the linears.

A tree step multiplies 1-32 rows by every weight of the model. The GEMM libraries torch calls are
built for many rows: on the 2-core Intel Xeon (AVX-512, AMX) MKL runs 16 rows at a fraction of
the GFLOPS it reaches on big matrices, and reads the weights of one row at about what the memory
gives; MKL's packed copies (workers/model/cpu_linear.py `mkl`) help but need one per row count.

Here (csrc/small_gemm.cpp) the weight [N, K] is packed in panels of 64 output features, each
panel K x 64 contiguous (float32 `[P, K, 64]`; bf16 `[P, K/2, 64, 2]`, pairs of k side by side
for AVX-512 BF16's dot product). A block of up to 6 rows keeps 24 accumulators in registers; in
float32 the blocks take turns over 64 k of a panel, finding it in L1, while each of their k steps
asks for one line of the next 64 k into L2. Panels are split between
threads (torch's own OpenMP pool). In bf16 on CPUs with AMX (Sapphire Rapids and later) the
panels are laid out as AMX tiles instead (`[P, K/32, 4, 16, 16, 2]`): one tile multiply does 16
rows x 32 k x 16 outputs, so up to 16 rows cost one pass over the weights at the memory's speed.
float32 accumulates in float32 in k order (not MKL's order: results agree to rounding); bf16
accumulates in float32 and rounds once, as F.linear does. A lone block of 2-6 float32 rows
prefetches its panel a few k rows ahead (the hardware prefetcher alone left it waiting on memory).
When it is used: workers/model/cpu_linear.py (`small`). Tried and dropped: one pass for up to 16 rows
over 16-wide panels (one accumulator per row): slower at every row count, since a single
accumulator chain per row is bound by the multiply-add latency.

The rest of a layer is many small torch ops, each costing more in dispatch on these CPUs than its
arithmetic for a tree's rows; fused here, each in one pass, and each faster than the torch ops
it replaces:
- `rms_norm`: F.rms_norm's ~6 ops and the residual add before it (61 times a forward);
- `silu_mul`: SwiGLU's chunk, silu and multiply;
- `rope_store`: a step's rotary embedding and KV write, every request in one call (torch: ~10 ops a
  layer and two strided writes a request);
- `tree_attention` (csrc/attention.cpp): every request's attention over its own KV in one call,
  tasks of one kv head and 16 query rows split between the threads; short prefills too (up to
  768 keys over a float32 KV, 256 over bf16: workers/model/llama_forward.py), marked causal: a block
  of rows reads keys only up to its own last row. torch: a flash-attention call a request, each
  with its own fixed cost. The whole forward is faster with it than with torch's rope and
  attention, at 1 row and at 16, in fp32 and bf16;
- `layer_stack` (csrc/decoder.cpp): all of a step's decoder layers in one call, the kernels above
  without the ~10 Python calls a layer between them; `argmax_rows`, greedy acceptance's argmax.
Each step above made the whole SmolLM2 forward on the Intel Xeon faster, side by side with the
torch path it replaced, at 1 row and at 16, in fp32 and bf16; the figures are in README.md, "CPU
kernels and weight layouts". They round as torch's ops would (bf16 after each op of
the rope, as transformers does), except that float32 products may be fused into one multiply-add
and attention sums in its own order (results agree to an ulp or two).

The kernels are compiled on first use (torch.utils.cpp_extension, a one-off build, cached under
~/.cache/torch_extensions, one build at a time across processes, `_build_and_load`;
scripts/setup.sh builds them), once per kernel path (`PATHS`: AVX-512 with BF16 and AMX, AVX-512
without them, or AVX2 + FMA), the widest this x86-64 CPU's flags allow; `path()` says which runs,
`available(dtype)` whether any can run here (`unavailable_reason` why not), every caller keeps
another path, SPECGATE_SMALL_GEMM=0 turns them off, SPECGATE_SMALL_GEMM=<path> picks one and
SPECGATE_AMX=0 turns off the AMX tiles alone. Without a C++ compiler (deploy/Dockerfile's slim
image has none) they are unavailable and torch's paths run.
"""
from __future__ import annotations

import os
import platform
import shutil
import threading
from functools import lru_cache
from pathlib import Path

import torch

PANEL = 64                  # output features per panel (csrc/small_gemm.cpp: NR)
# Head dims `tree_attention` is built for (csrc/attention.cpp: D = 16 * DV, one template each;
# the rope's half-heads also need D % 32 == 0): a 32..256 range of common models' heads.
ATTENTION_HEAD_DIMS = (32, 64, 96, 128, 256)
_SOURCES = [Path(__file__).parent / "csrc" / name for name in ("small_gemm.cpp", "attention.cpp",
                                                                      "decoder.cpp")]
# -fopenmp: at::parallel_for is inline OpenMP; the extension binds to the libgomp.so.1 torch has
# already loaded (same soname), so it shares torch's thread pool rather than starting another.
_COMMON = ["-O3", "-fopenmp"]
# The kernel paths, widest first: the CPU flags each needs (/proc/cpuinfo's names) and what it is
# compiled with. One source (csrc/, written against csrc/simd.h's 16-lane vector layer) compiled
# once per path, each its own extension: the kernels' blocking and summation order stay the same
# on every path, so they agree with each other and one fix reaches all; only simd.h's layer and
# the register blocking differ (AVX2 has half the registers, each half the width). AMX
# instructions are only emitted where the kernel asks for them, and run only where `_amx()` found
# the CPU and the OS permit them; the avx512f and AVX2 paths have no AMX or BF16 dot products
# (plain float32 multiply-adds of the widened bf16 instead).
PATHS: dict[str, tuple[frozenset[str], list[str]]] = {
    "avx512_bf16": (frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_bf16"}),
                    ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma", "-mamx-tile",
                     "-mamx-bf16"]),
    # Skylake / Cascade Lake servers: AVX-512 without BF16 dot products or AMX. The 16-lane layer
    # is then native, and bf16 widens to float32 by shifts (exact) before plain multiply-adds, as
    # on AVX2; the 32 registers keep the wide blocking.
    "avx512f": (frozenset({"avx512f", "avx512bw", "avx512vl", "fma"}),
                ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma"]),
    "avx2": (frozenset({"avx2", "fma", "f16c"}), ["-mavx2", "-mfma", "-mf16c"]),
}
_lock = threading.Lock()


def cpuinfo_field(name: str) -> str:
    """The first /proc/cpuinfo value of `name` ("vendor_id", "flags"); "" where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(name):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _cpu_flags() -> set[str]:
    return set(cpuinfo_field("flags").split())


def path_unsupported(name: str) -> str | None:
    """Why kernel path `name` cannot run on this machine's CPU, or None where it can."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"not an x86-64 CPU ({platform.machine()})"
    missing = PATHS[name][0] - _cpu_flags()
    return f"CPU lacks {', '.join(sorted(missing))}" if missing else None


def supported_paths() -> list[str]:
    """The kernel paths this CPU can run, widest first."""
    return [name for name in PATHS if path_unsupported(name) is None]


@lru_cache(maxsize=1)
def _module():
    """The compiled extension of the widest path this CPU runs (SPECGATE_SMALL_GEMM=<path> picks
    one), or None where none can be built or run (the reason is kept)."""
    global unavailable_reason, loaded_path
    loaded_path = None
    choice = os.environ.get("SPECGATE_SMALL_GEMM", "1")
    if choice == "0":
        unavailable_reason = "disabled by SPECGATE_SMALL_GEMM=0"
        return None
    if choice in PATHS:
        names = [choice]
    else:
        names = list(PATHS)
    reasons = {name: path_unsupported(name) for name in names}
    runnable = [name for name in names if reasons[name] is None]
    if not runnable:
        unavailable_reason = "; ".join(f"{name}: {why}" for name, why in reasons.items())
        return None
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:      # checked before any build already made is reused
        unavailable_reason = f"no C++ compiler ({compiler}) to build them"
        return None
    try:
        mod = load_path(runnable[0])
    except RuntimeError as exc:
        unavailable_reason = str(exc)
        return None
    loaded_path = runnable[0]
    return mod


unavailable_reason: str | None = None
loaded_path: str | None = None      # the kernel path `_module` loaded, once it has


def path() -> str:
    """Which path runs the CPU kernels here: a PATHS name, or "torch" (none: torch's ops)."""
    return loaded_path if _module() is not None else "torch"


def serving_path(dtype: torch.dtype, device: torch.device) -> str:
    """The kernel path a model of `dtype` on `device` runs: a PATHS name, or "torch" (none)."""
    return path() if available(dtype, device) else "torch"


def serving_note(dtype: torch.dtype, device: torch.device) -> str:
    """The start-up line saying which path runs the CPU kernels for such a model, and why not."""
    name = serving_path(dtype, device)
    if name != "torch":
        return f"CPU kernels: {name}"
    if device.type != "cpu":
        why = f"the model is on {device.type}"
    elif dtype not in (torch.float32, torch.bfloat16):
        why = f"they serve float32 and bfloat16, not {str(dtype).removeprefix('torch.')}"
    else:
        why = str(unavailable_reason)
    return f"CPU kernels: torch's ops ({why})"


def _name(path_name: str) -> str:
    return f"specgate_small_gemm_{path_name}"


@lru_cache(maxsize=None)
def load_path(name: str):
    """The extension of kernel path `name` (built on first use); RuntimeError saying why where it
    cannot be built. The caller checks that the CPU runs it (`path_unsupported`)."""
    # torch builds (and checks, even when the build is cached) with $CXX or c++; without one, as in
    # the python:3.11-slim image, say so rather than have torch try, warn at length and fail.
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C++ compiler ({compiler}) to build them")
    try:
        with _lock:
            return _build_and_load(_name(name), _COMMON + PATHS[name][1])
    except Exception as exc:   # no compiler, no ninja, old torch headers: fall back, say why
        raise RuntimeError(f"build failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}") from exc


def _build_and_load(name: str, flags: list[str]):
    """torch's `load` under an flock of our own in the build directory.

    torch marks a build in progress with a lock *file* that its builder deletes when done; a
    build killed half way (Ctrl-C on a first start, a CI job cancelled) leaves the file behind, and
    every later load then waits on it forever, silently. An flock dies with its process, so while
    we hold ours no other specgate process is building, and a lock file found then is such a
    leftover: it is removed, and this load builds."""
    import fcntl

    from torch.utils.cpp_extension import _get_build_directory, load

    build_dir = Path(_get_build_directory(name, verbose=False))
    with open(build_dir / "specgate.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)        # released when the file closes or the process dies
        (build_dir / "lock").unlink(missing_ok=True)
        return load(name=name, sources=[str(p) for p in _SOURCES], extra_cflags=flags,
                    extra_ldflags=["-fopenmp"], build_directory=str(build_dir), verbose=False)


def available(dtype: torch.dtype, device: torch.device = torch.device("cpu")) -> bool:
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and _module() is not None


@lru_cache(maxsize=1)
def _amx() -> bool:
    """AMX-BF16 here: the CPU has it and Linux grants this process the tile state."""
    if os.environ.get("SPECGATE_AMX", "1") == "0" or not {"amx_tile", "amx_bf16"} <= _cpu_flags():
        return False
    mod = _module()
    return mod is not None and bool(mod.amx_permit())


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> panels, P = ceil(N/64), zero-padded: float32 [P, K, 64]; bf16 [P, ceil(K/2), 64, 2],
    or AMX tiles [P, K/32, 4, 16, 16, 2] where AMX runs and K is a multiple of 32."""
    n, k = weight.shape
    panels = -(-n // PANEL)
    w = weight.detach()
    if panels * PANEL != n:
        w = torch.cat([w, w.new_zeros(panels * PANEL - n, k)])
    if weight.dtype == torch.float32:
        return w.view(panels, PANEL, k).transpose(1, 2).contiguous()               # [P, K, 64]
    if weight.dtype == torch.bfloat16:
        if k % 32 == 0 and _amx():
            # AMX tiles: per 32 k and per 16 of the panel's outputs, 16 k-pairs x 16 outputs x 2
            t = w.view(panels, 4, 16, k // 32, 16, 2).permute(0, 3, 1, 4, 2, 5)   # [P, K/32, 4, 16, 16, 2]
            return t.contiguous()
        if k % 2:
            w = torch.cat([w, w.new_zeros(w.shape[0], 1)], dim=1)
        k2 = w.shape[1] // 2
        return w.view(panels, PANEL, k2, 2).permute(0, 2, 1, 3).contiguous()       # [P, K/2, 64, 2]
    raise ValueError(f"small_gemm packs float32 or bfloat16, not {weight.dtype}")


def max_rows(packed: torch.Tensor) -> int:
    """Up to how many rows this packed weight's kernel beats torch's path (workers/model/cpu_linear.py
    has the measurements): float32 64; bf16 with AMX 32; bf16 dot products 6 (one block)."""
    if packed.dtype == torch.float32:
        return 64
    return 32 if packed.dim() == 6 else 6


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias) -> [M, out_features], W given packed (`pack`); bias float32 [N]
    whatever x's dtype (the kernel adds it before rounding; callers convert it once)."""
    return _module().linear(x.contiguous(), packed, out_features, _EMPTY if bias is None else bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual_delta: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of x [M, H] in one call (float32 arithmetic, rounded once to x's dtype). With
    `residual_delta`, first x += residual_delta **in place** (the residual add fused in)."""
    return _module().rms_norm(x, _EMPTY if residual_delta is None else residual_delta.contiguous(),
                              weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for the fused gate/up linear's output [M, 2I] -> [M, I], in one call."""
    return _module().silu_mul(gate_up.contiguous())


def rope_store(qkv: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
               k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], layer: int,
               starts: list[int], rows: list[int], lengths: list[int], n_heads: int,
               n_kv_heads: int) -> torch.Tensor:
    """One layer of a step, every request at once: rotate the rows' queries and keys (cos /
    sin_signed [T, D] at their positions, rotate_half's sign in sin_signed) and write request i's
    keys and values (rows starts[i]..+rows[i]) to its cache (float32 [L, Hkv, capacity, D]) in layer
    `layer` at slots lengths[i]... Returns the queries [T, Hq, D] float32. Rounded as torch's ops
    would (in bf16 after each op of the rope, as transformers does)."""
    return _module().rope_store(qkv, cos, sin_signed, k_caches, v_caches, layer, starts, rows, lengths,
                                n_heads, n_kv_heads)


def tree_attention(q: torch.Tensor, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], layer: int,
                   starts: list[int], rows: list[int], lengths: list[int], masks: list[torch.Tensor],
                   pasts: list[torch.Tensor | None], dtype: torch.dtype,
                   causal: list[bool] | None = None) -> torch.Tensor:
    """Attention of every request's rows of a step over its own cache (their KV written there by
    `rope_store`): request i's rows see slots [0, lengths[i]) through pasts[i] ([rows, length]
    additive float32, None: all visible) and its new rows through masks[i] ([rows, rows] additive
    float32). q [T, Hq, D] float32 -> [T, Hq*D] in dtype; rows of no request are left unset.
    causal[i]: request i's rows never see a later row (a prefill; the caller checks), so each
    block of rows reads only the keys up to its own last row (about half a prefill's work)."""
    return _module().tree_attention(q, k_caches, v_caches, layer, starts, rows, lengths, masks,
                                    [no_past(p) for p in pasts],
                                    [False] * len(rows) if causal is None else causal, dtype)


def layer_stack(layers: list[list[torch.Tensor]], n_heads: int, n_kv_heads: int, head_dim: int, hidden: int,
                intermediate: int, eps: float):
    """A model's decoder layers held for `forward` in one call (csrc/decoder.cpp): per layer
    [ln1, wqkv, bqkv, wo, bo, ln2, wgu, bgu, wdown, bdown, q_norm, k_norm], the linears `pack`ed,
    each bias float32 or empty, the q/k norms' weights [D] (Qwen3's, applied with `eps`) or empty.
    `.forward(x, cos, sin, k_caches, v_caches, starts, rows, lengths, masks, pasts, causal,
    logits)` runs every layer over the packed rows x [T, H] (the residual stream, updated in
    place; T within every linear's `max_rows`) as the lean forward's loop does, and returns the
    last layer's MLP output [T, H] not yet added to x (empty with `logits` false: a prefill, which
    stops after the last layer's KV). Arguments as `rope_store` / `tree_attention`'s, pasts with
    `no_past()` for None."""
    return _module().LayerStack(layers, n_heads, n_kv_heads, head_dim, hidden, intermediate, eps)


def no_past(past: torch.Tensor | None) -> torch.Tensor:
    """The kernels' "every cached slot visible": an empty tensor for None."""
    return _EMPTY if past is None else past


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """[R, V] float32 or bf16 -> [R] int64: each row's largest value's index, the first of equals
    (torch.argmax's choice, except that NaN is never chosen). One pass over bf16 rows, where
    torch converts them to float32 first (README.md, "CPU kernels and weight layouts")."""
    return _module().argmax_rows(x.contiguous())


_EMPTY = torch.empty(0)
