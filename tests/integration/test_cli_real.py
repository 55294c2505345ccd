"""`specgate generate` and `specgate bench engine` (also per kernel path) end to end on the real
default model."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def specgate(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specgate.cli", *args], capture_output=True, text=True,
                          timeout=600, check=check)


def test_generate_writes_one_record_per_prompt(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in [
        {"messages": [{"role": "user", "content": "What is the capital of France?"}]},
        {"prompt": "One, two, three, four, five, six,"},
    ]) + "\n")
    out = tmp_path / "out.json"
    specgate("generate", "--prompts", str(prompts), "--max-tokens", "24", "--json", str(out))
    records = json.loads(out.read_text())
    assert len(records) == 2
    for r in records:
        assert set(r) >= {"text", "token_ids", "steps", "tau_mean"}
        assert 1 <= len(r["token_ids"]) <= 24 and r["steps"] >= 1
        assert r["tau_mean"] == pytest.approx(len(r["token_ids"]) / r["steps"], abs=1e-3)
    assert "Paris" in records[0]["text"]


def test_generate_refuses_a_prompt_longer_than_the_context(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "word " * 9000}) + "\n")
    proc = specgate("generate", "--prompts", str(prompts), check=False)
    assert proc.returncode == 2
    assert "context is 8192 tokens" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bench_engine_reports_the_agreed_keys(tmp_path):
    out = tmp_path / "bench.json"
    specgate("bench", "engine", "--workload", "copy", "--limit", "1", "--max-tokens", "16", "--json", str(out))
    report = json.loads(out.read_text())
    for key in ("speedup_vs_hf_greedy", "speedup_vs_hf_prompt_lookup", "tau_mean", "alpha", "identical",
                "step_outside_forward_ms"):
        assert key in report
    assert report["identical"] is True


def test_bench_engine_runs_each_kernel_path_asked_for_side_by_side(tmp_path):
    from workers.model import small_gemm
    paths = small_gemm.supported_paths()
    if not paths:
        pytest.skip("this CPU runs no kernel path")
    out = tmp_path / "paths.json"
    specgate("bench", "engine", "--workload", "copy", "--limit", "1", "--max-tokens", "16",
             "--kernel-paths", f"{paths[0]},torch", "--json", str(out))
    report = json.loads(out.read_text())
    assert report["kernel_paths"] == [paths[0], "torch"] and report["identical"] is True
    assert {name: p["cpu_kernels"] for name, p in report["paths"].items()} == {paths[0]: paths[0], "torch": "torch"}
    assert report[f"vs_{paths[0]}"][paths[0]]["specgate_tok_s"] == 1.0
    assert report[f"vs_{paths[0]}"]["torch"]["specgate_tok_s"] > 0


def test_bench_drafters_compares_a_merge_with_its_parts(tmp_path):
    out = tmp_path / "drafters.json"
    specgate("bench", "drafters", "--workloads", "copy,agentic", "--per-workload", "1", "--warmup", "1",
             "--max-tokens", "24", "--json", str(out))
    report = json.loads(out.read_text())
    # plain decoding ("none") runs first: the baseline of tokens/s and the throughput model
    assert set(report["drafters"]) == {"none", "ngram", "suffix", "merge:ngram+suffix"}
    assert report["identical"] is True and report["prompts"] == 2 and report["warmup_prompts"] == 2
    assert report["best_single"] in ("ngram", "suffix")
    assert report["drafters"]["none"]["tau"] == 1.0
    for name, d in report["drafters"].items():
        assert set(d["tau_by_workload"]) == {"copy", "agentic"}
        assert name == "none" or d["tau"] > 1.0
    assert report["tau_vs_best_single"]["merge:ngram+suffix"] > 0
