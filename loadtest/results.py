"""What every benchmark's `--json` file carries besides its figures: a `meta` block saying how,
when, at which commit and on what machine they were measured.

A figure without its machine is no figure on these CPUs: the same run differs several-fold
between a 2-core VM with AVX-512 (where the engine's CPU kernels load) and one without, and a
figure without its commit cannot be compared with the next run. So every writer goes through
`write_result`, which puts

    "meta": {"command": "specgate bench stall --chunks 0,24 --json results/bench_stall.json",
             "date": "2026-12-07T10:21:03Z", "commit": "387656e" (+ "-dirty" with uncommitted
             changes to tracked files), "machine": {"cpu", "cores", "flags": {avx2, fma, avx512f,
             avx512bw, avx512vl, avx512_bf16, amx}}, "torch": "2.13.0"}

first in the file. `specgate docs` (tools/bench_docs.py) prints it beside each result in
docs/benchmarks.md. It lives here, the lowest layer that writes results (`loadtest compare` and
`soak` do, and tools import from loadtest, never the other way). No torch import: its version
is read from the installed package's metadata.
"""
from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any, Mapping, Sequence

REPO = Path(__file__).resolve().parents[1]     # the code being measured: its commit is the one
# The instruction-set extensions the engine's speed turns on (workers/model/csrc needs AVX-512
# F, BW, VL and BF16; AMX tiles serve bf16 linears where present; without AVX-512 the linears run
# on oneDNN's AVX2/FMA path).
FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx")


def write_result(path: str | Path, report: Mapping[str, Any],
                 argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Write `report` to `path` as JSON with a fresh `meta` block first; return what was written."""
    stamped = {"meta": meta(argv), **{k: v for k, v in report.items() if k != "meta"}}
    Path(path).write_text(json.dumps(stamped, indent=1) + "\n", encoding="utf-8")
    return stamped


def meta(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """How, when, at which commit and where: `argv` defaults to this process's command line."""
    return {"command": command_line(sys.argv if argv is None else argv),
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "commit": commit(), "machine": machine(), "torch": _version("torch")}


def command_line(argv: Sequence[str]) -> str:
    """The command as a user would type it: the program's name, not its install path
    (`python -m specgate.cli` is `specgate` too)."""
    if not argv:
        return ""
    program = Path(argv[0])
    name = "specgate" if program.parts[-2:] == ("specgate", "cli.py") else program.name
    return " ".join([name, *(shlex.quote(a) for a in argv[1:])])


def commit(root: Path = REPO) -> str | None:
    """`git rev-parse --short HEAD` of the code being measured, "-dirty" when a tracked file has
    uncommitted changes (the figures then belong to no commit exactly); None outside a checkout."""
    try:
        head = _git(root, "rev-parse", "--short", "HEAD")
        changed = _git(root, "status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("-dirty" if changed else "")


def machine(cpuinfo: str | None = None) -> dict[str, Any]:
    """The CPU's model, the cores this process may use and the flags in `FLAGS` (None each where
    the platform does not say, e.g. outside Linux). `cpuinfo`: /proc/cpuinfo's text (tests)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
        except OSError:
            cpuinfo = ""
    fields = _first_cpu(cpuinfo)
    flags = set(fields["flags"].split()) if "flags" in fields else None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": fields.get("model name") or platform.processor() or platform.machine(),
            "cores": cores, "flags": {f: _has(flags, f) for f in FLAGS}}


def _has(flags: set[str] | None, name: str) -> bool | None:
    if flags is None:
        return None
    if name == "amx":               # tiles and their bf16 multiply: what the kernels would use
        return {"amx_tile", "amx_bf16"} <= flags
    return name in flags


def _first_cpu(cpuinfo: str) -> dict[str, str]:
    """The first processor's `key: value` lines (every core of a VM reports the same)."""
    out: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            if out:
                break
            continue
        key, _, value = line.partition(":")
        out.setdefault(key.strip(), value.strip())
    return out


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10,
                          check=True).stdout.strip()


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None
