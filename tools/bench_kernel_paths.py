"""`specgate bench engine --kernel-paths ...`: the single-stream engine benchmark once per CPU kernel
path (workers/model/small_gemm.py PATHS, or "torch": the kernels off), side by side in one run.

A process loads one kernel path for good (`small_gemm._module` is chosen once, at the first call),
so each path runs in a subprocess of its own with SPECGATE_SMALL_GEMM naming it, one after the
other on the same prompts, and the parent writes one report: each path's tokens/s and its ratios
to the first path's. Each subprocess also times transformers' greedy `generate` in the same
conditions; the paths' speed-ups over it are the ratios to trust on a shared machine, whose load
may change between one subprocess and the next.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from workers.model import small_gemm

REPO = Path(__file__).resolve().parents[1]
# The figures each path's report keeps (bench_engine's summary names; lossless and near_ties
# below float32 only, where "identical" is judged against the engine's own plain decoding), and
# those compared by ratio.
KEPT = ("specgate_tok_s", "specgate_plain_tok_s", "hf_greedy_tok_s", "speedup_vs_hf_greedy",
        "speedup_vs_specgate_plain", "tau_mean", "identical", "lossless", "near_ties", "step_forward_ms",
        "cpu_kernels")
COMPARED = ("specgate_tok_s", "specgate_plain_tok_s", "speedup_vs_hf_greedy")
# One path's run, in its subprocess: bench_engine with the parent's arguments (argv: their file,
# the report's). A program of its own, not a function here: bench_engine calls this module.
_CHILD = """
import json, sys
from pathlib import Path
from tools.bench_engine import bench_engine
from workers.contract import TreeBudget
kwargs = json.loads(Path(sys.argv[1]).read_text())
kwargs["budget"] = TreeBudget(*kwargs["budget"])
Path(sys.argv[2]).write_text(json.dumps(bench_engine(**kwargs)))
"""


def parse_paths(text: str) -> list[str]:
    """--kernel-paths: names of PATHS, "torch" (the kernels off) and "all" (every path this CPU
    runs, widest first), comma-separated; a path this CPU cannot run is refused, saying why."""
    names: list[str] = []
    for word in (w.strip() for w in text.split(",")):
        names.extend(small_gemm.supported_paths() if word == "all" else [word] if word else [])
    for name in names:
        if name != "torch" and name not in small_gemm.PATHS:
            raise ValueError(f"--kernel-paths: unknown path {name!r}; one of {', '.join(small_gemm.PATHS)}, "
                             f"torch or all")
        why = None if name == "torch" else small_gemm.path_unsupported(name)
        if why is not None:
            raise ValueError(f"--kernel-paths: {name}: {why}")
    if not names:
        raise ValueError(f"--kernel-paths {text!r}: no path (this CPU runs none of {', '.join(small_gemm.PATHS)})")
    if len(set(names)) != len(names):
        raise ValueError(f"--kernel-paths: each path once, got {text!r}")
    return names


def compare_paths(names: list[str], kwargs: dict[str, Any]) -> dict[str, Any]:
    """bench_engine(**kwargs) on each path in turn, each in its own process; one report."""
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="specgate-paths-") as tmp:
        spec = Path(tmp) / "kwargs.json"
        spec.write_text(json.dumps(kwargs))
        for i, name in enumerate(names):
            print(f"[kernel path {i + 1}/{len(names)}] {name}", file=sys.stderr, flush=True)
            out = Path(tmp) / f"{name}.json"
            env = {**os.environ, "SPECGATE_SMALL_GEMM": "0" if name == "torch" else name,
                   # the code measured is this checkout's, whatever is installed
                   "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
            done = subprocess.run([sys.executable, "-c", _CHILD, str(spec), str(out)], env=env, cwd=REPO)
            if done.returncode != 0:
                raise RuntimeError(f"the {name} run failed (exit {done.returncode})")
            runs[name] = json.loads(out.read_text())
            if runs[name]["cpu_kernels"] != name:   # it ran another path than the one asked for
                raise RuntimeError(f"asked for kernel path {name}, the run reports {runs[name]['cpu_kernels']}")
    return summarize(names, runs)


def summarize(names: list[str], runs: dict[str, dict]) -> dict[str, Any]:
    first = runs[names[0]]
    ratios = {name: {key: round(runs[name][key] / first[key], 3) for key in COMPARED} for name in names}
    return {"workload": first["workload"], "prompts": first["prompts"], "max_tokens": first["max_tokens"],
            "dtype": first.get("dtype", "float32"), "drafter": first["drafter"], "kernel_paths": names,
            "paths": {name: {key: runs[name].get(key) for key in KEPT} for name in names},
            f"vs_{names[0]}": ratios,
            "identical": all(runs[name]["identical"] for name in names),
            "lossless": all(runs[name].get("lossless", runs[name]["identical"]) for name in names),
            "runs": runs}

