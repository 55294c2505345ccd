"""The engine's device and dtype settings (workers/model/device.py), on the CPU this suite runs on: the
choices resolve as documented, a GPU asked for where there is none is a clear error, and the
float16 path runs losslessly (speculation changes nothing) through the same code a GPU runs."""
from __future__ import annotations

import argparse
import copy
import time

import pytest
import torch

from gateway.cli.serve import add_arguments, settings_from_args
from gateway.settings import Settings
from scheduler.generation import Engine, GenerationRequest
from tests.helpers import OracleDrafter, hf_greedy
from workers.contract import SamplingParams, TreeBudget
from workers.model.device import elapsed, resolve_device, resolve_dtype
from workers.drafters.base import NoneDrafter
from workers.model.llama_forward import LlamaForward
from workers.speculation.verifier import Verifier


def test_auto_is_the_cpu_where_torch_sees_no_gpu():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    assert resolve_device("CPU") == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here")
@pytest.mark.parametrize("name", ["cuda", "cuda:0"])
def test_a_gpu_asked_for_where_there_is_none_is_an_error_naming_it(name):
    with pytest.raises(ValueError, match="sees no CUDA GPU"):
        resolve_device(name)


@pytest.mark.parametrize("name", ["gpu", "cuda:x", "mps", "tpu:0"])
def test_unknown_devices_are_refused(name):
    with pytest.raises(ValueError, match="unknown device"):
        resolve_device(name)


def test_dtypes_include_float16():
    assert resolve_dtype("float16") is torch.float16
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("float8")


def test_the_flag_and_the_environment_set_the_device(monkeypatch):
    p = argparse.ArgumentParser()
    add_arguments(p)
    assert settings_from_args(p.parse_args(["--device", "cpu"])).device == "cpu"
    monkeypatch.setenv("SPECGATE_DEVICE", "cuda:1")
    assert Settings().device == "cuda:1"
    monkeypatch.setenv("SPECGATE_DEVICE", "gpu0")
    with pytest.raises(ValueError):
        Settings()


def test_elapsed_times_the_work():
    assert elapsed(lambda: time.sleep(0.02), "cpu") >= 0.02


def test_float16_decodes_the_same_with_and_without_speculation(tiny_model):
    half = copy.deepcopy(tiny_model).half()
    forward = LlamaForward(half)
    assert forward.dtype == torch.float16 and not forward.fused
    prompts = [[5, 9, 13, 5, 9, 13, 5], [40, 41, 42, 43, 44, 45, 46, 47]]
    reqs = [GenerationRequest(f"r{i}", tuple(p), 24, SamplingParams(), frozenset({2})) for i, p in enumerate(prompts)]
    plain = Engine(Verifier(forward, max_tree_tokens=16), NoneDrafter(), TreeBudget(0, 0)).generate(reqs)
    truth = {r.request_id: out.token_ids for r, out in zip(reqs, plain)}
    spec = Engine(Verifier(forward, max_tree_tokens=16), OracleDrafter(truth, 128, "mixed"),
                  TreeBudget(12, 6), adaptive=False).generate(reqs)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    # and it is the model: the float16 output follows transformers' float16 greedy
    agree = sum(a == b for p, o in zip(prompts, plain) for a, b in zip(o.token_ids, hf_greedy(half, p, 24, eos=2)))
    assert agree >= 0.9 * sum(len(o.token_ids) for o in plain)


@pytest.mark.parametrize("attention", ["loop", "padded", "flex"])
@pytest.mark.parametrize("arch", ["smollm2", "qwen2-mixed"])
def test_the_device_generic_path_decodes_as_the_cpu_kernel_path(arch, attention):
    """What a GPU runs (no CPU kernels; each attention option of workers/model/batched_attention.py),
    greedy over batched trees of several requests with speculation on, token for token as the
    CPU-kernel path and as transformers: a Llama with grouped heads, and a Qwen2 whose windowed
    layers bind (its masks differ by layer)."""
    from tests.helpers import device_generic
    from tests.unit.test_conformance import MAX_NEW, model
    from tests.unit.test_engine import prompts

    m = model(arch)
    ps = prompts(6)
    refs = [hf_greedy(m, p, MAX_NEW, eos=2) for p in ps]
    reqs = [GenerationRequest(f"r{i}", tuple(p), MAX_NEW, SamplingParams(), frozenset({2})) for i, p in enumerate(ps)]
    truth = {r.request_id: ref for r, ref in zip(reqs, refs)}

    def run(forward):
        drafter = OracleDrafter(truth, 128, "mixed", seed=3)
        return Engine(Verifier(forward, max_tree_tokens=16), drafter, TreeBudget(12, 6), adaptive=False).generate(reqs)

    kernel, generic = run(LlamaForward(m)), run(device_generic(m, attention=attention))
    assert [o.token_ids for o in generic] == [o.token_ids for o in kernel] == refs
    assert sum(o.accepted for o in generic) > 20 and sum(o.drafted for o in generic) > sum(o.accepted for o in generic)


@pytest.mark.parametrize("attention", ["loop", "padded"])
def test_what_a_step_builds_past_the_verifiers_host_inputs_names_the_device(tiny_model, attention):
    """The verifier builds a step's ids, positions and masks on the host (one copy each, made by
    the forward); past that, every tensor the forward, the batched attention and the KV cache
    create names the configured device (on a GPU, one that did not would be a host tensor)."""
    from tests.helpers import DeviceAudit, device_generic

    forward = device_generic(tiny_model, attention=attention)
    prompts = [[5, 9, 13, 5, 9, 13, 5], [40, 41, 42, 43, 44, 45, 46, 47], list(range(3, 80))]
    reqs = [GenerationRequest(f"r{i}", tuple(p), 16, SamplingParams(), frozenset({2})) for i, p in enumerate(prompts)]
    truth = {r.request_id: out.token_ids for r, out in zip(reqs, Engine(
        Verifier(LlamaForward(tiny_model), max_tree_tokens=16), NoneDrafter(), TreeBudget(0, 0)).generate(reqs))}
    with DeviceAudit("workers/model/llama_forward.py", "workers/model/packed_attention.py",
                     "workers/model/batched_attention.py", "workers/model/kv_cache.py") as audit:
        out = Engine(Verifier(forward, max_tree_tokens=16), OracleDrafter(truth, 128, "mixed"),
                     TreeBudget(12, 6), adaptive=False).generate(reqs)
    assert {o.request_id: o.token_ids for o in out} == truth and sum(o.accepted for o in out) > 0
    assert {m[0] for m in audit.made} >= {"empty", "tensor"} and audit.off_device(forward.device) == []
