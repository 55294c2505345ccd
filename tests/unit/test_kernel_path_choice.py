"""Which CPU kernel path (workers/model/small_gemm.py PATHS) a CPU gets, and what each path's build
may contain: the widest its flags allow, or the one SPECGATE_SMALL_GEMM names; and no instruction
outside its flags in its compiled kernels (a CPU without AVX-512 BF16 or AMX, such as a Skylake
server, would die of SIGILL on one; this machine, which has them, would not notice)."""
from __future__ import annotations

import re
import shutil
import subprocess
from types import SimpleNamespace

import pytest
import torch

from tests.kernel_paths import kernel_path  # noqa: F401  (the fixture: every kernel path)
from workers.model import small_gemm

BASE = {"fpu", "sse2", "avx", "avx2", "fma", "f16c"}
AVX512 = {"avx512f", "avx512bw", "avx512vl", "avx512cd", "avx512dq"}
CPUS = {   # /proc/cpuinfo flags of the server classes, as far as the paths tell them apart
    "sapphire_rapids": BASE | AVX512 | {"avx512_bf16", "amx_tile", "amx_bf16"},
    "cooper_lake": BASE | AVX512 | {"avx512_bf16"},
    "cascade_lake": BASE | AVX512 | {"avx512_vnni"},
    "skylake_sp": BASE | AVX512,
    "zen3": BASE,
    "sandy_bridge": {"fpu", "sse2", "avx"},
}


@pytest.fixture
def cpu(monkeypatch):
    """Make small_gemm see a CPU with the given flags (x86-64, a compiler present), its paths'
    loads recorded rather than built; `_module` chooses afresh and is reset afterwards."""
    monkeypatch.delenv("SPECGATE_SMALL_GEMM", raising=False)
    monkeypatch.setattr(small_gemm.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(small_gemm, "shutil", SimpleNamespace(which=lambda name: f"/usr/bin/{name}"))
    monkeypatch.setattr(small_gemm, "load_path", lambda name: f"<{name} kernels>")

    def choose(flags: set[str]):
        monkeypatch.setattr(small_gemm, "_cpu_flags", lambda: set(flags))
        small_gemm._module.cache_clear()
        return small_gemm._module()

    yield choose
    small_gemm._module.cache_clear()
    small_gemm.unavailable_reason = small_gemm.loaded_path = None


@pytest.mark.parametrize("name,expected", [
    ("sapphire_rapids", "avx512_bf16"), ("cooper_lake", "avx512_bf16"), ("cascade_lake", "avx512f"),
    ("skylake_sp", "avx512f"), ("zen3", "avx2")])
def test_each_server_class_gets_the_widest_path_its_flags_allow(cpu, name, expected):
    assert cpu(CPUS[name]) == f"<{expected} kernels>"
    assert small_gemm.loaded_path == expected and small_gemm.path() == expected
    assert small_gemm.supported_paths()[0] == expected
    assert small_gemm.serving_note(torch.float32, torch.device("cpu")) == f"CPU kernels: {expected}"


def test_a_cpu_without_avx2_gets_none_and_is_told_what_each_path_lacks(cpu):
    assert cpu(CPUS["sandy_bridge"]) is None
    reason = small_gemm.unavailable_reason
    assert "avx512f: CPU lacks avx512bw, avx512f, avx512vl, fma" in reason
    assert "avx2: CPU lacks avx2, f16c, fma" in reason and "avx512_bf16: CPU lacks" in reason
    assert small_gemm.path() == "torch"


@pytest.mark.parametrize("forced", list(small_gemm.PATHS))
def test_the_environment_forces_any_path_the_cpu_runs(cpu, monkeypatch, forced):
    monkeypatch.setenv("SPECGATE_SMALL_GEMM", forced)
    assert cpu(CPUS["sapphire_rapids"]) == f"<{forced} kernels>" and small_gemm.path() == forced


def test_a_forced_path_the_cpu_lacks_is_refused_not_replaced(cpu, monkeypatch):
    monkeypatch.setenv("SPECGATE_SMALL_GEMM", "avx512f")
    assert cpu(CPUS["zen3"]) is None
    assert small_gemm.unavailable_reason == "avx512f: CPU lacks avx512bw, avx512f, avx512vl"


# What each path's build may not contain (objdump's AT&T syntax; symbol names removed, since
# functions are named after bf16): BF16 dot products and conversions, AMX tiles; and for AVX2 any
# AVX-512 register (zmm, mask registers, the upper 16 xmm/ymm).
BF16_AMX = r"bf16|\btile|\bldtilecfg|\bsttilecfg"
FORBIDDEN = {"avx512_bf16": None, "avx512f": BF16_AMX,
             "avx2": BF16_AMX + r"|%zmm|%k[0-7]|%[xy]mm(1[6-9]|2[0-9]|3[01])\b"}


def _instructions(so: str) -> list[str]:
    out = subprocess.run(["objdump", "-d", "--no-show-raw-insn", so], capture_output=True, text=True,
                         check=True).stdout
    return [re.sub(r"<[^>]*>", "", line.split("\t", 1)[1]) for line in out.splitlines()
            if re.match(r"\s+[0-9a-f]+:\t", line)]


@pytest.mark.skipif(shutil.which("objdump") is None, reason="no objdump to read the builds")
def test_each_paths_build_holds_only_instructions_its_flags_allow(kernel_path):
    code = _instructions(small_gemm._module().__file__)
    assert len(code) > 1000                              # the kernels were read
    forbidden = FORBIDDEN[kernel_path]
    if forbidden is None:   # the widest path: where the check's patterns do find BF16 and AMX
        assert any("vdpbf16ps" in i for i in code) and any("tdpbf16ps" in i for i in code)
        assert any(re.search(FORBIDDEN["avx2"], i) for i in code)
        return
    bad = [i for i in code if re.search(forbidden, i)]
    assert not bad, f"{kernel_path} build holds {len(bad)} instructions beyond its flags: {bad[:5]}"
