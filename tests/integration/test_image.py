"""deploy/Dockerfile, checked without a container runtime (CI machines have none, and no registry
to pull `python:3.11-slim` from): its build context is what the package needs, its pins, lock and
user agree with the rest of the project, and what the image does at run time works: as uid 1000, with
HOME=/tmp and the model prefetched at build time into a cache the user cannot write, the built-in
model resolves and generates (the Helm chart runs the container with a read-only root filesystem).
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per Dockerfile instruction, continuation lines joined."""
    out, pending = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        word, _, rest = pending.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        pending = ""
    return out


def values(word: str) -> list[str]:
    return [rest for w, rest in instructions() if w == word]


def copied() -> list[str]:
    """Every source path the COPY lines name (relative to the build context, the repo root)."""
    return [src for rest in values("COPY") for src in shlex.split(rest)[:-1]]


def args() -> dict[str, str]:
    out = {}
    for rest in values("ARG"):
        name, _, default = rest.partition("=")
        out[name] = default.strip('"')
    return out


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_build_context_holds_every_package_and_build_input():
    sources = copied()
    for src in sources:
        assert (ROOT / src).exists(), f"COPY {src}: not in the repository"
    assert {"pyproject.toml", "README.md"} <= set(sources)        # setuptools reads both
    assert "requirements.lock" in sources                         # what the image installs from
    packages = {p.rstrip("*") for p in pyproject()["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert packages <= {Path(s).name for s in sources}, "a package the wheel needs is not copied"


def test_pins_user_and_command_agree_with_the_project():
    a = args()
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert f'"{a["TORCH"]}"' in setup, "the image's torch pin differs from scripts/setup.sh's"
    # the dependencies come from the lock setup.sh installs too (tests/unit/test_lock.py: it pins the
    # ray extra, and nothing else is resolved), the package itself without any
    installs = " ".join(values("RUN"))
    assert "-r requirements.lock" in installs and "-r requirements.lock" in setup
    assert "--no-deps --no-build-isolation ." in installs

    from workers.model.loader import BUILTIN_MODELS
    assert a["PREFETCH_MODEL"] in BUILTIN_MODELS

    (user,) = values("USER")
    chart = yaml.safe_load((ROOT / "deploy" / "helm" / "specgate" / "values.yaml").read_text())
    assert int(user) != 0 and int(user) == chart["podSecurityContext"]["runAsUser"]

    from specgate.cli import build_parser
    (cmd,) = values("CMD")
    argv = json.loads(cmd)
    assert argv[0] == "specgate"
    parsed = build_parser().parse_args(argv[1:])          # exits (fails the test) if it does not parse
    assert (parsed.host, parsed.port) == ("0.0.0.0", 8000)
    (port,) = values("EXPOSE")
    assert int(port) == parsed.port == chart["service"]["port"]


def test_the_cpu_and_cuda_flavours_install_torch_from_their_own_index():
    froms = values("FROM")
    assert args()["FLAVOR"] == "cpu" and froms[-1] == "torch-${FLAVOR}"
    stages = {f.split(" AS ")[1] for f in froms if " AS " in f}
    assert {"torch-cpu", "torch-cuda"} <= stages
    index = dict(e.split("=", 1) for e in values("ENV") if e.startswith("TORCH_INDEX="))
    assert index["TORCH_INDEX"] in ("https://download.pytorch.org/whl/cpu", "${TORCH_CUDA_INDEX}")
    assert "/whl/cu" in args()["TORCH_CUDA_INDEX"]
    assert '--index-url "$TORCH_INDEX" "$TORCH"' in " ".join(values("RUN"))


def build_context(tmp: Path) -> Path:
    """What `COPY` puts in /opt/specgate/src, and nothing else."""
    ctx = tmp / "ctx"
    ctx.mkdir()
    for src in copied():
        path = ROOT / src
        if path.is_dir():
            shutil.copytree(path, ctx / src, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(path, ctx / src)
    return ctx


@pytest.mark.slow
def test_a_wheel_built_from_the_copied_context_carries_code_data_and_the_command(tmp_path):
    ctx = build_context(tmp_path)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "dist"), str(ctx)], check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("specgate-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for needed in ("gateway/ray_serve/deployments.py", "gateway/grpc_api/proto/specgate_pb2_grpc.py",
                   "scheduler/profiles/default.json", "loadtest/workloads/chat.jsonl",
                   "workers/model/llama_forward.py"):
        assert needed in names, needed
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "specgate = specgate.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                    reason="needs root and setpriv (util-linux) to run a command as another uid")
def test_the_image_user_runs_from_a_read_only_prefetched_cache(tmp_path):
    from workers.model.loader import DEFAULT_MODEL, resolve_model

    uid = 1000
    built = resolve_model(DEFAULT_MODEL, progress=False)       # what the build step prefetched
    cache = tmp_path / "opt" / "cache"
    shutil.copytree(built, cache / "models" / DEFAULT_MODEL)
    for path in [cache, *cache.rglob("*")]:                      # root-owned, a+rX, no one writes
        mode = 0o555 if path.is_dir() else 0o444
        os.chmod(path, mode)
    home = tmp_path / "home"
    home.mkdir()
    os.chown(home, uid, uid)
    prompts = home / "p.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user",
                                                 "content": "What is the capital of France?"}]}) + "\n")
    os.chown(prompts, uid, uid)
    # the image (python:3.11-slim) has no C++ compiler, so our CPU kernels never build there
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "SPECGATE_CACHE": str(cache),
           "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": str(ROOT), "CXX": str(tmp_path / "no-c++")}
    # uid 1000 that may read and search everything (the venv and checkout may sit in a private
    # temp dir, as in CI) but write only what it owns: CAP_DAC_READ_SEARCH, not CAP_DAC_OVERRIDE
    as_user = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
               "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search"]
    path = subprocess.run([*as_user, sys.executable, "-m", "specgate.cli", "model", "path", DEFAULT_MODEL],
                          env=env, capture_output=True, text=True, timeout=120)
    assert path.returncode == 0, path.stderr
    assert path.stdout.strip() == str(cache / "models" / DEFAULT_MODEL)
    out = home / "out.json"
    gen = subprocess.run([*as_user, sys.executable, "-m", "specgate.cli", "generate", "--prompts",
                          str(prompts), "--max-tokens", "12", "--json", str(out)],
                         env=env, capture_output=True, text=True, timeout=300)
    assert gen.returncode == 0, gen.stderr
    assert "Paris" in json.loads(out.read_text())[0]["text"]
    assert not [p for p in cache.rglob("*") if p.name.startswith(".tmp")]   # nothing tried to build
