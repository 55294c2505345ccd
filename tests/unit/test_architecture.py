"""The import rules of docs/ARCHITECTURE.md, read from the source (ast), so that they stay true.

Layers, lowest first: workers (device work and the scheduler↔worker contract) → scheduler
(lifecycle, policies, sizing, the step loop) → gateway (HTTP, gRPC, tenancy, Ray, builders) →
loadtest (a client of a running gateway) → tools (offline: simulator, benches, distillation) →
specgate (the command line). A module may import only from its own layer or the ones below;
no module imports itself back through others (no cycle).
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ("workers", "scheduler", "gateway", "loadtest", "tools", "specgate")


def modules() -> dict[str, Path]:
    out = {}
    for pkg in LAYERS:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Our modules that `name` imports, anywhere in it (function-level imports count too)."""
    found = set()
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".")[: len(name.split(".")) - node.level + (1 if is_pkg else 0)]
                base = ".".join(parts + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


GRAPH = {name: imports(name, path, modules()) for name, path in modules().items()}


def layer(module: str) -> int:
    return LAYERS.index(module.split(".")[0])


def upward(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} -> {b}" for a, bs in graph.items() for b in bs if layer(b) > layer(a))


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in list(graph):
        if v not in index:
            visit(v)
    return found


def test_every_import_points_down_or_sideways():
    assert upward(GRAPH) == []


def test_there_is_no_import_cycle():
    assert cycles(GRAPH) == []


def test_the_rules_catch_what_they_forbid():
    """The graph holds the arrows it should, and a planted upward arrow and a planted circle
    are caught."""
    assert "workers.contract" in GRAPH["scheduler.loop"]
    assert "scheduler.sizing" in GRAPH["scheduler.policies.base"]
    assert "gateway.builders.embedded" in GRAPH["gateway.cli.serve"]
    planted = {**GRAPH, "workers.speculation.tree": GRAPH["workers.speculation.tree"] | {"scheduler.sizing"}}
    assert upward(planted) == ["workers.speculation.tree -> scheduler.sizing"]
    circle = {**GRAPH, "scheduler.request": GRAPH["scheduler.request"] | {"scheduler.loop"}}
    assert any({"scheduler.loop", "scheduler.request"} <= set(c) for c in cycles(circle))


@pytest.mark.parametrize("module", ["scheduler.loop", "scheduler.policies", "scheduler.sizing",
                                    "scheduler.store", "scheduler.generation", "workers.contract",
                                    "workers.fake_worker", "workers.prompts"])
def test_the_scheduler_and_the_contract_import_no_torch(module):
    """Policies, sizing and the step loop are tested in microseconds and run without device code;
    a fresh interpreter shows what importing them loads."""
    code = f"import sys, {module}; print('torch' in sys.modules, 'numpy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out[0] == "False", f"importing {module} imports torch"
