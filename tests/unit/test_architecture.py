"""The import rules of docs/ARCHITECTURE.md, read from the source (ast), so that they stay true.

Layers, lowest first: workers (device work and the scheduler↔worker contract) → scheduler
(lifecycle, policies, sizing, the step loop) → gateway (HTTP, gRPC, tenancy, Ray, builders) →
loadtest (a client of a running gateway) → tools (offline: simulator, benches, distillation) →
specgate (the command line). A module may import only from its own layer or the ones below;
no module imports itself back through others (no cycle), and no sub-package (`gateway.builders`,
`gateway.ray_serve`, …; a module at a layer's root is one of its own) imports itself back through
others either: function-level imports count, so a cycle hidden inside functions is found too.
"""
from __future__ import annotations

import ast
import pickle
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
    return imports_in(name, path.read_text(encoding="utf-8"), path.name == "__init__.py", known)


def imports_in(name: str, source: str, is_pkg: bool, known: dict[str, Path]) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(source)):
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


def package(module: str) -> str:
    """The sub-package a module belongs to: `gateway.builders` for `gateway.builders.embedded`;
    a module at a layer's root (`gateway.settings`) is its own."""
    return ".".join(module.split(".")[:2])


def packages(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The import graph between sub-packages (an edge for any import between their modules)."""
    out: dict[str, set[str]] = {}
    for a, bs in graph.items():
        out.setdefault(package(a), set()).update(package(b) for b in bs if package(b) != package(a))
    return out


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


def test_there_is_no_import_cycle_between_sub_packages():
    assert cycles(packages(GRAPH)) == []


def test_the_rules_catch_what_they_forbid():
    """The graph holds the arrows it should, and a planted upward arrow and a planted circle
    are caught."""
    assert "workers.contract" in GRAPH["scheduler.loop"]
    assert "scheduler.sizing" in GRAPH["scheduler.policies.step_budget"]
    assert "gateway.builders.embedded" in GRAPH["gateway.cli.serve"]
    planted = {**GRAPH, "workers.speculation.tree": GRAPH["workers.speculation.tree"] | {"scheduler.sizing"}}
    assert upward(planted) == ["workers.speculation.tree -> scheduler.sizing"]
    circle = {**GRAPH, "scheduler.request": GRAPH["scheduler.request"] | {"scheduler.loop"}}
    assert any({"scheduler.loop", "scheduler.request"} <= set(c) for c in cycles(circle))


def test_a_cycle_between_sub_packages_through_a_function_level_import_is_caught():
    """The Ray deployments once imported the embedded builder's helpers inside functions while
    the Ray builder imported the deployments: no module-level cycle, but a cycle between
    `gateway.builders` and `gateway.ray_serve`. Planted again, it is found."""
    known = modules()
    planted = "def build():\n    from gateway.builders.embedded import build_embedded\n"
    found = imports_in("gateway.ray_serve.deployments", planted, False, known)
    assert found == {"gateway.builders.embedded"}
    graph = {**GRAPH, "gateway.ray_serve.deployments": GRAPH["gateway.ray_serve.deployments"] | found}
    assert cycles(graph) == []                      # no cycle between modules …
    assert ["gateway.builders", "gateway.ray_serve"] in cycles(packages(graph))   # … but one here


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


# What a Ray ingress replica runs: its class's module (every import of it at module level, so
# importing it is all the replica imports of ours), and what it calls to build its app and serve.
INGRESS_MODULES = ["gateway.ray_serve.ingress", "gateway.http.app", "gateway.ray_serve.remote",
                   "gateway.tenancy.tenants", "gateway.tenancy.limits", "gateway.grpc_api.messages",
                   "gateway.replay", "gateway.responses.service", "gateway.assembly.serving",
                   "gateway.assembly.replica", "scheduler.store", "ray.serve"]


def test_an_ingress_replica_imports_no_torch(tmp_path):
    """An ingress replica serves HTTP and gRPC over a remote scheduler: no model code, no torch
    (hundreds of MB and seconds per replica). It detokenizes with the scheduler replica's own
    tokenizer, sent over pickled: unpickling it must not load torch either."""
    from workers.model.loader import load_tokenizer

    tree = ast.parse((ROOT / "gateway/ray_serve/ingress.py").read_text(encoding="utf-8"))
    top = {id(n) for n in tree.body}
    nested = [n.lineno for n in ast.walk(tree)
              if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in top]
    assert nested == [], f"gateway/ray_serve/ingress.py imports inside functions (lines {nested})"
    pickled = tmp_path / "tokenizer.pickle"
    pickled.write_bytes(pickle.dumps(load_tokenizer(progress=False)))
    code = (f"import pickle, sys; import {', '.join(INGRESS_MODULES)}; "
            f"tok = pickle.loads(open({str(pickled)!r}, 'rb').read()); "
            "assert tok.decode(tok('hello world')['input_ids']) == 'hello world'; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]", f"an ingress replica imports torch: {out}"


def test_scheduler_modules_and_classes_stay_small():
    """Every scheduler module within 400 lines and every class within 250: one job each
    (the planner's parts, the step loop's)."""
    big = []
    for path in sorted((ROOT / "scheduler").rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        lines = len(text.splitlines())
        if lines > 400:
            big.append(f"{path.relative_to(ROOT)}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 250:
                big.append(f"{path.relative_to(ROOT)}:{node.name}: "
                           f"{node.end_lineno - node.lineno + 1} lines")
    assert big == []
