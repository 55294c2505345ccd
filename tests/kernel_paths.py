"""Every CPU kernel path (workers/model/small_gemm.py PATHS) a test runs on: those this machine's
CPU supports, each loaded and used in turn; the others skipped with a reason naming the path, so a
CI log says which paths ran here and which did not."""
from __future__ import annotations

import pytest

from workers.model import small_gemm


def use_kernel_path(name: str, monkeypatch) -> None:
    """The kernels of path `name` stand in for the default's until the test ends (every wrapper of
    small_gemm calls `_module()`, and `pack` asks `_amx()` of the same module: a path built
    without AMX must not be handed AMX tiles). A path this CPU cannot run is skipped, naming it
    and why."""
    why = small_gemm.path_unsupported(name)
    if why is not None:
        pytest.skip(f"{name} kernel path: {why}")
    mod = small_gemm.load_path(name)      # a path the CPU runs must build: a failure fails the test
    monkeypatch.setattr(small_gemm, "_module", lambda: mod)
    monkeypatch.setattr(small_gemm, "loaded_path", name)   # what `path()` reports, as at start
    amx = getattr(small_gemm._amx, "__wrapped__", small_gemm._amx)         # once patched: already so
    monkeypatch.setattr(small_gemm, "_amx", amx)                            # asks `mod`, uncached


@pytest.fixture(params=list(small_gemm.PATHS))
def kernel_path(request, monkeypatch) -> str:
    """One kernel path for the test, each of PATHS in turn (`use_kernel_path`)."""
    use_kernel_path(request.param, monkeypatch)
    return request.param
