"""Which path runs the CPU kernels (workers/model/small_gemm.py), as `specgate serve` states it at
start and /metrics keeps it: on a tiny model loaded here, through the real assembly; the path
chosen here, and each path this CPU runs, forced in turn by SPECGATE_SMALL_GEMM."""
from __future__ import annotations

import json

import pytest
import torch

from gateway.assembly.serving import assemble
from gateway.assembly.target import local_target
from gateway.settings import Settings
from tests.helpers import tiny_model_dir
from workers.model import small_gemm
from workers.runtime import load_runtime


def test_the_widest_path_the_cpu_supports_is_the_one_loaded():
    supported = small_gemm.supported_paths()
    if not small_gemm.available(torch.float32):
        assert small_gemm.path() == "torch"
        return
    assert small_gemm.path() == supported[0]             # PATHS is widest first
    assert small_gemm.serving_note(torch.float32, torch.device("cpu")) == f"CPU kernels: {supported[0]}"


def test_models_the_kernels_do_not_serve_say_why():
    half = small_gemm.serving_note(torch.float16, torch.device("cpu"))
    assert small_gemm.serving_path(torch.float16, torch.device("cpu")) == "torch"
    assert half == "CPU kernels: torch's ops (they serve float32 and bfloat16, not float16)"
    assert small_gemm.serving_path(torch.float32, torch.device("meta")) == "torch"
    assert "the model is on meta" in small_gemm.serving_note(torch.float32, torch.device("meta"))


def test_serve_states_the_kernel_path_at_start_and_in_metrics(tmp_path):
    _states_the_path(tmp_path, small_gemm.path() if small_gemm.available(torch.float32) else "torch")


@pytest.mark.parametrize("name", list(small_gemm.PATHS))
def test_a_path_forced_by_the_environment_is_stated_at_start_and_in_metrics(tmp_path, monkeypatch, name):
    why = small_gemm.path_unsupported(name)
    if why is not None:
        pytest.skip(f"{name} kernel path: {why}")
    if not small_gemm.available(torch.float32):
        pytest.skip(f"no CPU kernels here: {small_gemm.unavailable_reason}")
    monkeypatch.setenv("SPECGATE_SMALL_GEMM", name)
    small_gemm._module.cache_clear()                 # chosen afresh, as at a start
    small_gemm._amx.cache_clear()
    try:
        _states_the_path(tmp_path, name)
    finally:
        monkeypatch.delenv("SPECGATE_SMALL_GEMM")
        small_gemm._module.cache_clear()
        small_gemm._amx.cache_clear()


def _states_the_path(tmp_path, expected: str) -> None:
    model = tiny_model_dir(tmp_path / "tiny")
    rt = load_runtime(str(model), progress=False)
    profile = tmp_path / "profile.json"           # given, so that no step costs are measured here
    profile.write_text(json.dumps({"source": "test", "curves": [
        {"batch": 1, "tokens": [1, 8], "step_s": [0.01, 0.02]}]}))
    settings = Settings(model=str(model), max_batch=2, step_profile=profile)
    target = local_target(settings, False, rt)
    assert target.kernel_path == expected
    assert target.kernel_note.startswith(f"CPU kernels: {expected}")
    emb = assemble(settings, target)
    try:
        assert emb.kernel_note == target.kernel_note
        body = emb.metrics.render()[0].decode()
        assert f'specgate_cpu_kernel_info{{path="{expected}"}} 1.0' in body
        assert body.count("specgate_cpu_kernel_info{") == 1
    finally:
        emb.step_loop.store.close()
