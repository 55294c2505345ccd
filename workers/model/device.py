"""Where the engine runs, and how long a piece of work there took.

One setting picks the device for everything that runs the target or a model drafter: the
weights, every request's KV, the step's inputs and masks (`--device` / `SPECGATE_DEVICE`).
`auto` takes CUDA when torch sees a GPU, else the CPU, so the same command serves on a laptop
and on a GPU verifier replica.

GPU work is asynchronous: a timer read right after a launch measures the launch, not the work.
`elapsed` synchronises the device before each reading, so the step-cost profile the planner
sizes trees from (workers/speculation/profiling.py) is the work's own cost on either device.
"""
from __future__ import annotations

import time
from typing import Callable

import torch

DEVICE_CHOICES = ("auto", "cpu", "cuda")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str | torch.device = "auto") -> torch.device:
    """'auto' (CUDA when torch sees a GPU, else CPU), 'cpu', 'cuda' or 'cuda:N' (or a
    torch.device: another part's, checked the same way). A GPU asked for where torch sees none is
    an error naming the cause, not a silent CPU run."""
    name = (str(name) if isinstance(name, torch.device) else name or "auto").strip().lower()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda" or (name.startswith("cuda:") and name[5:].isdigit()):
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r}: this torch ({torch.__version__}) sees no CUDA GPU "
                             "(a CPU build, or no driver); use --device cpu or auto")
        dev = torch.device(name)
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {name!r}: only {torch.cuda.device_count()} CUDA GPU(s) here")
        return dev
    raise ValueError(f"unknown device {name!r}; choose auto, cpu, cuda or cuda:N")


def resolve_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose from {', '.join(DTYPES)}")
    return DTYPES[name]


def synchronize(device: torch.device | str) -> None:
    """Wait for the work queued on `device` (a no-op on the CPU, whose ops return when done)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def elapsed(fn: Callable[[], object], device: torch.device | str) -> float:
    """Seconds `fn` takes on `device`, its queued work included (synchronised before and after)."""
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - t0


def free_bytes(device: torch.device | str) -> int:
    """Free memory on a CUDA device now (what the driver reports: other processes' use counted)."""
    free, _total = torch.cuda.mem_get_info(torch.device(device))
    return int(free)
