"""Every CPU kernel path (workers/model/small_gemm.py PATHS) a test runs on: those this machine's
CPU supports, each loaded and used in turn; the others skipped with a reason naming the path, so a
CI log says which paths ran here and which did not."""
from __future__ import annotations

import pytest

from workers.model import small_gemm


@pytest.fixture(params=list(small_gemm.PATHS))
def kernel_path(request, monkeypatch) -> str:
    """The kernels of one path stand in for the default's for the test (every wrapper of
    small_gemm calls `_module()`); a path this CPU cannot run is skipped, naming it and why."""
    name = request.param
    why = small_gemm.path_unsupported(name)
    if why is not None:
        pytest.skip(f"{name} kernel path: {why}")
    mod = small_gemm.load_path(name)      # a path the CPU runs must build: a failure fails the test
    monkeypatch.setattr(small_gemm, "_module", lambda: mod)
    return name
