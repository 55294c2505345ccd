"""The few-row kernel (workers/model/small_gemm.py) against F.linear: any row count, ragged panels, odd
inner sizes, bias, float32 and bf16; and the packed layouts themselves."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.kernel_paths import kernel_path  # noqa: F401  (the fixture: every kernel path)
from workers.model import small_gemm

DTYPES = [dt for dt in (torch.float32, torch.bfloat16) if small_gemm.available(dt)]
pytestmark = pytest.mark.skipif(not DTYPES, reason=f"small_gemm unavailable: {small_gemm.unavailable_reason}")


# bf16 twice where the CPU has AMX: its tile kernel, and the dot-product kernel other CPUs get
KERNELS = [(torch.float32, False)] * (torch.float32 in DTYPES) + [
    (torch.bfloat16, amx) for amx in (False, True) if torch.bfloat16 in DTYPES and (not amx or small_gemm._amx())]


@pytest.mark.parametrize("dtype,amx", KERNELS)
@pytest.mark.parametrize("out_features,in_features", [(64, 32), (100, 33), (960, 576), (7, 1536), (130, 200)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_f_linear(kernel_path, dtype, amx, out_features, in_features, with_bias, monkeypatch):
    if amx and not small_gemm._module().amx_permit():
        pytest.skip(f"{kernel_path} kernel path: built without AMX")
    monkeypatch.setattr(small_gemm, "_amx", lambda: amx)
    g = torch.Generator().manual_seed(out_features * 1000 + in_features)
    weight = torch.randn(out_features, in_features, generator=g).to(dtype)
    bias = torch.randn(out_features, generator=g) if with_bias else None
    packed = small_gemm.pack(weight)
    assert (packed.dim() == 6) == (amx and in_features % 32 == 0)    # AMX tiles need 32 k a block
    for rows in (1, 2, 5, 6, 7, 12, 13, 16, 33, 70):    # blocks of 6 (AMX: 16), with remainders
        x = torch.randn(rows, in_features, generator=g).to(dtype)
        y = small_gemm.linear(x, packed, out_features, bias)
        assert y.shape == (rows, out_features) and y.dtype == dtype
        # the reference in float32 from the same (bf16-rounded) inputs
        ref = F.linear(x.float(), weight.float(), bias)
        if dtype == torch.float32:
            torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-4)
        else:   # accumulated in float32, rounded once to bf16: within one bf16 ulp
            torch.testing.assert_close(y.float(), ref, rtol=8e-3, atol=1e-2)


@pytest.mark.skipif(torch.float32 not in DTYPES, reason="float32 kernel unavailable")
@pytest.mark.parametrize("in_features", [576, 200])
def test_float32_rows_are_the_same_sums_whatever_the_batch(kernel_path, in_features):
    # Several rows run in blocks over chunks of k with their partial sums parked in y; alone, a
    # row runs in one pass. Each row must still be summed in the same order, bit for bit: a tree
    # node's logits may not depend on how many other nodes share its step.
    g = torch.Generator().manual_seed(in_features)
    weight = torch.randn(150, in_features, generator=g)
    bias = torch.randn(150, generator=g)
    packed = small_gemm.pack(weight)
    x = torch.randn(40, in_features, generator=g)
    alone = torch.cat([small_gemm.linear(x[i:i + 1], packed, 150, bias) for i in range(40)])
    for rows in (7, 8, 12, 16, 20, 40):
        assert torch.equal(small_gemm.linear(x[:rows], packed, 150, bias), alone[:rows]), rows


def test_a_build_killed_half_way_does_not_hang_the_next_load():
    # torch's own marker of a build in progress, as a build killed half way leaves it: torch alone
    # would wait on it forever. A fresh process (this one has its module already) must load.
    from torch.utils.cpp_extension import _get_build_directory
    stale = Path(_get_build_directory(small_gemm._name(small_gemm.path()), verbose=False)) / "lock"
    stale.touch()
    try:
        run = subprocess.run([sys.executable, "-c", "import torch; from workers.model import small_gemm; "
                              "print(small_gemm.available(torch.float32), small_gemm.unavailable_reason)"],
                             cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True,
                             timeout=300)
        left = stale.exists()
    finally:
        stale.unlink(missing_ok=True)
    assert run.stdout.split()[:1] == ["True"], run.stdout + run.stderr
    assert not left


def test_packed_layouts_put_each_weight_where_the_kernel_reads_it():
    w = torch.arange(70 * 5, dtype=torch.float32).view(70, 5)       # [N=70, K=5]
    p = small_gemm.pack(w)
    assert p.shape == (2, 5, 64)                                     # 2 panels, zero-padded
    assert p[1, 3, 2] == w[64 + 2, 3] and p[1, :, 6:].abs().sum() == 0
    b = small_gemm.pack(w.to(torch.bfloat16))
    assert b.shape == (2, 3, 64, 2)                                  # k in pairs, the odd one padded
    assert b[0, 1, 10, 1] == w[10, 3] and b[1, 2, 0, 1] == 0


def test_amx_layout_puts_each_weight_in_its_tile(monkeypatch):
    if torch.bfloat16 not in DTYPES or not small_gemm._amx():
        pytest.skip("no AMX here")
    w = torch.randn(70, 64).to(torch.bfloat16)                        # [N=70, K=64]
    p = small_gemm.pack(w)
    assert p.shape == (2, 2, 4, 16, 16, 2)                           # [P, K/32, 4, 16 k-pairs, 16, 2]
    # panel 0, k block 1, outputs 16-31 of the panel, k-pair 5, output 3, second of the pair
    assert p[0, 1, 1, 5, 3, 1] == w[16 + 3, 32 + 2 * 5 + 1]
    assert p[1, 0, 0, 2, 4, 0] == w[64 + 4, 2 * 2]
    assert p[1, :, 0, :, 6:].abs().sum() == 0 and p[1, :, 1:].abs().sum() == 0   # padding
    assert small_gemm.max_rows(p) > small_gemm.max_rows(torch.zeros(1, 1, 64, 2, dtype=torch.bfloat16))


def test_zero_rows_and_bad_layouts(kernel_path):
    if torch.float32 not in DTYPES:
        pytest.skip("float32 kernel unavailable")
    packed = small_gemm.pack(torch.randn(10, 8))
    assert small_gemm.linear(torch.randn(0, 8), packed, 10).shape == (0, 10)
    with pytest.raises(RuntimeError, match="panels"):
        small_gemm.linear(torch.randn(2, 8), packed, 200)
    with pytest.raises(RuntimeError, match="layout"):
        small_gemm.linear(torch.randn(2, 9), packed, 10)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        small_gemm.pack(torch.randn(4, 4).half())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 576), (16, 576), (5, 33), (300, 64)])
def test_rms_norm_with_and_without_the_residual_add(kernel_path, dtype, rows, hidden):
    g = torch.Generator().manual_seed(rows + hidden)
    x = torch.randn(rows, hidden, generator=g).to(dtype)
    w = torch.randn(hidden, generator=g).to(dtype)
    delta = torch.randn(rows, hidden, generator=g).to(dtype)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-2)
    torch.testing.assert_close(small_gemm.rms_norm(x.clone(), w, 1e-5), F.rms_norm(x, (hidden,), w, 1e-5), **tol)
    xa = x.clone()
    y = small_gemm.rms_norm(xa, w, 1e-5, delta)
    torch.testing.assert_close(xa, x + delta, rtol=0, atol=0)            # the add, in place, rounded as torch's
    torch.testing.assert_close(y, F.rms_norm(x + delta, (hidden,), w, 1e-5), **tol)


def test_switched_off_it_says_why_and_the_engine_keeps_torchs_paths(monkeypatch):
    from workers.model.cpu_linear import pick_backend
    monkeypatch.setenv("SPECGATE_SMALL_GEMM", "0")
    small_gemm._module.cache_clear()
    try:
        assert not small_gemm.available(torch.float32)
        assert "SPECGATE_SMALL_GEMM" in small_gemm.unavailable_reason
        assert pick_backend(torch.device("cpu"), torch.float32, "small") != "small"
    finally:
        monkeypatch.delenv("SPECGATE_SMALL_GEMM")
        small_gemm._module.cache_clear()
        small_gemm.unavailable_reason = None


def test_without_a_compiler_it_says_so_without_trying_a_build(monkeypatch, tmp_path):
    """As in the slim image: no c++ on the PATH. No build directory is made, nothing is run."""
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    small_gemm._module.cache_clear()
    try:
        assert not small_gemm.available(torch.float32)
        assert "no C++ compiler" in small_gemm.unavailable_reason
        assert not (tmp_path / "ext").exists()
    finally:
        monkeypatch.undo()
        small_gemm._module.cache_clear()
        small_gemm.unavailable_reason = None


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_torch(kernel_path, dtype):
    g = torch.Generator().manual_seed(3)
    gate_up = (torch.randn(7, 2 * 40, generator=g) * 6).to(dtype)          # 40: a ragged last vector
    gate_up[0, :6] = torch.tensor([-1e4, -88.0, -20.0, 0.0, 20.0, 1e4]).to(dtype)   # the clamps
    gate, up = gate_up.float().chunk(2, dim=-1)
    ref = F.silu(gate) * up
    out = small_gemm.silu_mul(gate_up)
    assert out.shape == (7, 40) and out.dtype == dtype
    tol = dict(rtol=2e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-2)
    torch.testing.assert_close(out.float(), ref, **tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_rows_matches_torch_first_of_equals(kernel_path, dtype):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 1000, generator=g).to(dtype)       # 1000: a ragged last vector
    x[1, 3] = x[1, 700] = 50.0                            # a tie: the first index wins
    x[2, 999] = 60.0                                      # the largest in the tail's lanes
    x[3] = float("-inf")                                  # nothing to choose: index 0
    x[4, 17] = float("nan")                               # NaN is never chosen
    got = small_gemm.argmax_rows(x)
    ref = torch.argmax(torch.nan_to_num(x.float(), nan=float("-inf")), dim=1)
    assert got.tolist() == ref.tolist() and got[1] == 3 and got[2] == 999 and got[3] == 0



def _ticks_inside(call, repeats: int) -> tuple[float, float]:
    """Run `call` `repeats` times on another thread while this one counts loop turns; returns
    (turns per second inside the calls, the calls' total seconds). A turn is counted only between
    the timestamps taken just before and just after a call."""
    import threading
    import time

    inside: list[tuple[float, float]] = []
    ticks: list[float] = []
    stop = threading.Event()

    def calls() -> None:
        try:
            for _ in range(repeats):
                t0 = time.perf_counter()
                call()
                inside.append((t0, time.perf_counter()))
        finally:
            stop.set()

    worker = threading.Thread(target=calls)
    worker.start()
    while not stop.is_set():
        ticks.append(time.perf_counter())
    worker.join()
    seconds = sum(b - a for a, b in inside)
    return sum(1 for t in ticks for a, b in inside if a < t < b) / seconds, seconds


@pytest.mark.skipif(torch.float32 not in DTYPES, reason="float32 kernel unavailable")
def test_a_kernel_call_lets_other_python_threads_run(kernel_path):
    # The step loop calls the kernels from its own thread while the gateway's event loop serves
    # every tenant from another: a kernel that held the GIL stopped the event loop for the whole
    # call (a forward is one call). Another thread's turns inside the calls are compared with its
    # turns while the same thread sleeps (GIL released) for as long, in the same test, so a busy
    # machine slows both alike. Holding the GIL, the only turns inside a call are those of a
    # switch at its start (at most one switch interval, 5 ms, of a call of ~100 ms or more).
    import time

    g = torch.Generator().manual_seed(7)
    weight = torch.randn(8192, 4096, generator=g)
    packed = small_gemm.pack(weight)
    x = torch.randn(256, 4096, generator=g)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)           # the kernel on one core, the counting thread on the other
    try:
        kernel_rate, seconds = _ticks_inside(lambda: small_gemm.linear(x, packed, 8192), 4)
        sleep_rate, _ = _ticks_inside(lambda: time.sleep(seconds / 4), 4)
    finally:
        torch.set_num_threads(threads)
    assert kernel_rate >= 0.25 * sleep_rate, (
        f"another thread ran {kernel_rate:.0f} turns/s inside the kernel's calls against "
        f"{sleep_rate:.0f} while sleeping: the kernel holds the GIL")
