"""`bench engine --kernel-paths`: which paths it runs, one process each with the path forced, this
checkout's code in each, a run that reports another path refused, and the ratios to the first
path (tools/bench_kernel_paths.py). The real benchmark per path: tests/integration/test_cli_real.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from specgate.cli import main
from tools import bench_kernel_paths as bkp
from workers.model import small_gemm

ALL = {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx2", "fma", "f16c"}


@pytest.fixture
def flags(monkeypatch):
    monkeypatch.setattr(small_gemm.platform, "machine", lambda: "x86_64")
    return lambda names: monkeypatch.setattr(small_gemm, "_cpu_flags", lambda: set(names))


def test_the_paths_named_all_and_torch(flags):
    flags(ALL)
    assert bkp.parse_paths("all") == list(small_gemm.PATHS)
    assert bkp.parse_paths("avx512f, torch") == ["avx512f", "torch"]
    flags(ALL - {"avx512_bf16"})                             # a Skylake / Cascade Lake server
    assert bkp.parse_paths("all,torch") == ["avx512f", "avx2", "torch"]


def test_unknown_unsupported_repeated_or_no_paths_are_refused(flags):
    flags({"avx2", "fma", "f16c"})
    with pytest.raises(ValueError, match="unknown path 'sse'"):
        bkp.parse_paths("avx2,sse")
    with pytest.raises(ValueError, match="avx512f: CPU lacks avx512bw, avx512f, avx512vl"):
        bkp.parse_paths("avx512f")
    with pytest.raises(ValueError, match="each path once"):
        bkp.parse_paths("avx2,all")
    flags(set())
    with pytest.raises(ValueError, match="no path"):
        bkp.parse_paths("all")


def _report(path: str, tok_s: float, greedy: float) -> dict:
    return {"workload": "copy", "prompts": 2, "max_tokens": 8, "dtype": "float32", "drafter": "ngram",
            "specgate_tok_s": tok_s, "specgate_plain_tok_s": tok_s / 2, "hf_greedy_tok_s": greedy,
            "speedup_vs_hf_greedy": tok_s / greedy, "identical": True, "cpu_kernels": path}


def test_each_path_runs_in_its_own_process_with_it_forced(monkeypatch):
    seen = []

    def fake_run(cmd, env, cwd):
        seen.append((env["SPECGATE_SMALL_GEMM"], env["PYTHONPATH"].split(os.pathsep)[0], cmd[0]))
        assert json.loads(open(cmd[-2]).read())["workload"] == "copy"     # the parent's arguments
        ran = "torch" if env["SPECGATE_SMALL_GEMM"] == "0" else env["SPECGATE_SMALL_GEMM"]
        with open(cmd[-1], "w") as f:
            json.dump(_report(ran, {"avx512f": 40.0, "avx2": 30.0, "torch": 10.0}[ran], 10.0), f)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(bkp.subprocess, "run", fake_run)
    report = bkp.compare_paths(["avx512f", "avx2", "torch"], {"workload": "copy"})
    assert seen == [("avx512f", str(bkp.REPO), sys.executable), ("avx2", str(bkp.REPO), sys.executable),
                    ("0", str(bkp.REPO), sys.executable)]
    assert report["kernel_paths"] == ["avx512f", "avx2", "torch"] and report["identical"]
    assert report["paths"]["avx2"]["specgate_tok_s"] == 30.0
    assert report["vs_avx512f"]["avx2"] == {"specgate_tok_s": 0.75, "specgate_plain_tok_s": 0.75,
                                            "speedup_vs_hf_greedy": 0.75}
    assert report["vs_avx512f"]["avx512f"]["specgate_tok_s"] == 1.0
    assert report["runs"]["torch"]["cpu_kernels"] == "torch"
    assert report["lossless"] and report["paths"]["avx2"]["lossless"] is None     # float32: no verdict


def test_below_float32_a_near_tie_is_lossless_but_not_identical():
    runs = {name: {**_report(name, 20.0, 10.0), "identical": name == "avx512f", "lossless": True,
                   "near_ties": int(name != "avx512f")} for name in ("avx512f", "avx2")}
    report = bkp.summarize(["avx512f", "avx2"], runs)
    assert report["lossless"] and not report["identical"] and report["paths"]["avx2"]["near_ties"] == 1
    runs["avx2"]["lossless"] = False
    assert not bkp.summarize(["avx512f", "avx2"], runs)["lossless"]


def test_a_run_on_another_path_than_asked_is_an_error(monkeypatch):
    def fake_run(cmd, env, cwd):
        with open(cmd[-1], "w") as f:
            json.dump(_report("avx2", 30.0, 10.0), f)        # e.g. the variable was not honoured
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(bkp.subprocess, "run", fake_run)
    with pytest.raises(RuntimeError, match="asked for kernel path avx512f, the run reports avx2"):
        bkp.compare_paths(["avx512f"], {})


def test_the_cli_refuses_kernel_paths_with_peers_or_streams(capsys):
    assert main(["bench", "engine", "--workload", "copy", "--kernel-paths", "all", "--peers", "llama.cpp"]) == 2
    assert "--kernel-paths compares specgate's own paths" in capsys.readouterr().err
    assert main(["bench", "engine", "--concurrency", "2", "--kernel-paths", "all"]) == 2
    assert "single-stream" in capsys.readouterr().err
