"""The lock files (scripts/lock.sh makes them; scripts/setup.sh and deploy/Dockerfile install from
them): every dependency pyproject.toml declares is pinned, exactly and with hashes, at a version its
range allows; setup and the image resolve nothing past them; and the Ray the image installs is the
Ray the Helm chart's RayService names (its `rayVersion`, and the ray pods' image)."""
from __future__ import annotations

import re
import shlex
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "requirements.lock"            # the runtime with the ray extra: what the image installs
DEV_LOCK = ROOT / "requirements-dev.lock"    # what the dev extra adds
CHART = ROOT / "deploy" / "helm" / "specgate"
# Where setup and the image run: a marker a declared dependency meets here, its pin must meet too.
ENVIRONMENTS = [
    {"sys_platform": "linux", "platform_system": "Linux", "platform_machine": machine,
     "python_version": "3.11", "python_full_version": "3.11.7", "implementation_name": "cpython",
     "platform_python_implementation": "CPython", "os_name": "posix"}
    for machine in ("x86_64", "aarch64")
]


@dataclass(frozen=True)
class Pin:
    version: str
    marker: Marker | None
    hashes: tuple[str, ...]


def read_lock(path: Path) -> dict[str, Pin]:
    """A pip requirements file as uv writes it: `name==version ; marker \\` then `--hash=` lines."""
    text = re.sub(r"\\\n", " ", path.read_text())
    pins = {}
    for line in text.splitlines():
        line = line.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        hashes = tuple(re.findall(r"--hash=(\S+)", line))
        req = Requirement(re.sub(r"--hash=\S+", "", line))
        (spec,) = req.specifier                  # exactly one clause, and it must be ==
        assert spec.operator == "==" and "*" not in spec.version, f"{path.name}: {req} is not exact"
        name = canonicalize_name(req.name)
        assert name not in pins, f"{path.name}: {name} twice"
        pins[name] = Pin(spec.version, req.marker, hashes)
    return pins


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def torch_pin() -> str:
    """setup.sh's torch pin (the image's ARG TORCH must equal it: tests/integration/test_image.py)."""
    (pin,) = set(re.findall(r'"(torch==[^"]+)"', (ROOT / "scripts" / "setup.sh").read_text()))
    return pin


def uncovered(declared: list[str], pins: dict[str, Pin]) -> list[str]:
    """Declared dependencies the pins leave out, or pin outside the declared range, where they apply."""
    out = []
    for text in declared:
        req = Requirement(text)
        name = canonicalize_name(req.name)
        for env in ENVIRONMENTS:
            if req.marker and not req.marker.evaluate(env):
                continue
            if name == "torch":                  # installed before the lock, at setup's own pin
                pinned = Requirement(torch_pin()).specifier
                if not any(req.specifier.contains(s.version, prereleases=True) for s in pinned):
                    out.append(f"{text} (setup pins {torch_pin()})")
            elif name not in pins:
                out.append(f"{text} (not pinned)")
            elif pins[name].marker and not pins[name].marker.evaluate(env):
                out.append(f"{text} (pinned only where {pins[name].marker})")
            elif not req.specifier.contains(pins[name].version, prereleases=True):
                out.append(f"{text} (pinned {pins[name].version})")
    return sorted(set(out))


def test_the_lock_pins_every_runtime_and_build_dependency():
    project = pyproject()
    declared = (project["project"]["dependencies"] + project["project"]["optional-dependencies"]["ray"]
                + project["build-system"]["requires"])
    assert uncovered(declared, read_lock(LOCK)) == []


def test_the_locks_together_pin_every_dev_dependency():
    both = read_lock(LOCK) | read_lock(DEV_LOCK)
    assert uncovered(pyproject()["project"]["optional-dependencies"]["dev"], both) == []


def test_a_dependency_the_lock_misses_or_pins_outside_its_range_is_found():
    pins = read_lock(LOCK)
    assert uncovered(["ninja>=1.11; platform_machine == 'x86_64'"], pins) == []
    assert uncovered(["left-pad>=1"], pins) == ["left-pad>=1 (not pinned)"]
    assert uncovered([f"ray<{pins['ray'].version}"], pins) == [f"ray<{pins['ray'].version} (pinned {pins['ray'].version})"]
    assert uncovered(["torch>=99"], pins) == [f"torch>=99 (setup pins {torch_pin()})"]


def test_every_pin_is_hashed_torch_is_left_to_setup_and_the_locks_do_not_overlap():
    runtime, dev = read_lock(LOCK), read_lock(DEV_LOCK)
    assert [n for n, p in (runtime | dev).items() if not p.hashes] == []
    assert "torch" not in runtime and "torch" not in dev
    assert set(runtime) & set(dev) == set()
    # what installs and builds the package is locked too (setup and the image build without isolation)
    assert {"pip", "setuptools", "wheel"} <= set(runtime)


def pip_installs(script: str) -> list[list[str]]:
    """The arguments of every `pip install` in a shell script or a Dockerfile (comments left out)."""
    text = re.sub(r"\\\n", " ", script)
    text = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    return [shlex.split(m.group(1)) for m in re.finditer(r"pip install ([^&;|\n]+)", text)]


def resolving(script: str) -> list[str]:
    """The installs that would resolve something: all but torch's (setup's pin, or the image's
    TORCH) must be --no-deps, hash-checked from a lock or built without fetching build tools."""
    out = []
    for args in pip_installs(script):
        if any(a.startswith("torch==") or a == "$TORCH" for a in args):
            continue
        locked = "-r" in args and "--require-hashes" in args
        if "--no-deps" not in args or not (locked or "--no-build-isolation" in args):
            out.append(" ".join(args))
    return out


@pytest.mark.parametrize("path", ["scripts/setup.sh", "deploy/Dockerfile"])
def test_setup_and_the_image_resolve_nothing_past_the_lock_but_torch(path):
    script = (ROOT / path).read_text()
    assert resolving(script) == []
    installs = pip_installs(script)
    locks = {args[i + 1] for args in installs for i, a in enumerate(args[:-1]) if a == "-r"}
    assert "requirements.lock" in locks, f"{path} does not install requirements.lock"


def test_an_install_that_resolves_is_found():
    assert resolving('pip install "$TORCH" && pip install ".[ray]"') == [".[ray]"]
    assert resolving("pip install --no-deps -e .\npip install -r requirements.lock") == \
        ["--no-deps -e .", "-r requirements.lock"]


def ray_versions(values: dict) -> dict[str, str]:
    """The Ray each place in the rendered chart names: the RayService's rayVersion, and per ray pod
    image either the specgate image (built from deploy/Dockerfile, so Ray from the lock) or an
    image tag's version (rayproject/ray:2.60.0-py311 -> 2.60.0)."""
    helm = pytest.importorskip("helm_python")
    out = helm.Chart.load(CHART).render({"adminKey": "adm-test-0123456789", **values}, name="sg", namespace="ml")
    docs = [d for path, text in out.items() if not path.endswith(".txt") for d in yaml.safe_load_all(text) if d]
    (service,) = [d for d in docs if d["kind"] == "RayService"]
    cluster = service["spec"]["rayClusterConfig"]
    found = {"rayVersion": str(cluster["rayVersion"])}
    specgate_image = yaml.safe_load((CHART / "values.yaml").read_text())["image"]["repository"]
    templates = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
    for template in templates:
        for container in template["spec"]["containers"]:
            repository, _, tag = container["image"].rpartition(":")
            if repository == specgate_image:
                found[container["image"]] = read_lock(LOCK)["ray"].version
            else:
                found[container["image"]] = re.match(r"\d+(\.\d+)*", tag).group(0) if re.match(r"\d", tag) else tag
    return found


def test_the_chart_names_the_ray_the_image_installs():
    ray = read_lock(LOCK)["ray"].version
    assert (ROOT / "requirements.lock").name in (ROOT / "deploy" / "Dockerfile").read_text()
    assert not re.search(r"ray\[?[a-z,]*\]?==", (ROOT / "deploy" / "Dockerfile").read_text()), \
        "the image pins ray itself, not through the lock"
    for values in ({}, {"ray": {"gpuWorkers": {"enabled": True}}}):
        versions = ray_versions(values)
        assert set(versions.values()) == {ray}, versions


def test_a_ray_image_of_another_version_is_found():
    versions = ray_versions({"ray": {"image": "rayproject/ray:2.9.3-py311"}})
    assert set(versions.values()) == {read_lock(LOCK)["ray"].version, "2.9.3"}
