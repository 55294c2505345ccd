"""Benchmark prompt sets: ``load_workload("copy")`` -> chat-style requests.

Each workload is a JSONL file shipped in ``loadtest/workloads/`` (rebuilt by
``python -m loadtest.build_workloads``); one record per line::

    {"id": "copy/json.dumps",
     "messages": [{"role": "user", "content": "Repeat the following text exactly, ..."}],
     "source": "python-stdlib:json.dumps"}

What each workload asks of the target, and so how much a prompt-lookup drafter can copy:

- ``copy``: repeat a stdlib documentation passage verbatim (the output is almost all in the prompt);
- ``extract``: quote parts of such a passage verbatim (sentences with a word, parameter
  descriptions, doctest examples, first sentences);
- ``summarize``: summarise such a passage (some phrases reused);
- ``chat``: open questions about Python, with no passage (little to copy);
- ``code``: complete a HumanEval function from its signature and docstring (system + user);
- ``agentic``: answer a task with one JSON tool call (system with tool schemas, two worked
  examples, then the task): many requests with near-identical outputs, one tenant.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

WORKLOADS = ("copy", "extract", "summarize", "chat", "code", "agentic")


def workload_path(name: str) -> Path:
    """Path of the packaged JSONL file of workload `name`."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose one of: {', '.join(WORKLOADS)}")
    # NOTE: loadtest/workloads/ holds data only (no __init__.py), so resolve it from the package.
    return Path(str(resources.files("loadtest").joinpath("workloads", f"{name}.jsonl")))


def load_workload(name: str) -> list[dict]:
    """Records of workload `name`, in file order: dicts with ``id``, ``messages``, ``source``."""
    with workload_path(name).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
