#!/usr/bin/env bash
# Regenerate the lock files that scripts/setup.sh and deploy/Dockerfile install from, with uv:
#   requirements.lock      the package with its `ray` extra, what builds it (pyproject's
#                          [build-system] requires) and pip: what the image installs
#   requirements-dev.lock  what the `dev` extra adds on top, at the same versions for what they share
# Every pin carries its hashes. The lock is universal (markers kept) for Python 3.11.
# torch is left out (setup and the image install it first, a CPU or a CUDA build), but torch's own
# dependencies are pinned, resolved against the CPU build so that no CUDA package is pulled in.
# uv keeps the versions already in the lock files; to move them:
#   bash scripts/lock.sh --upgrade                        # everything to the newest allowed
#   bash scripts/lock.sh --upgrade-package transformers   # one package
set -euo pipefail
cd "$(dirname "$0")/.."
# uv is a lock-time tool only, so it is not a dev dependency: a pinned copy goes into .venv.
UV=${UV:-$(command -v uv || true)}
if [ -z "$UV" ]; then
    [ -x .venv/bin/python ] || { echo "lock.sh: run bash scripts/setup.sh first (or put uv on PATH)" >&2; exit 1; }
    .venv/bin/python -m pip install -q "uv==0.13.9"
    UV=.venv/bin/uv
fi
# Where the torch CPU wheel comes from: this machine's wheel directory, else PyTorch's CPU index.
TORCH_PIN=$(grep -o '"torch==[^"]*"' scripts/setup.sh | head -1 | tr -d '"')
TORCH_LINKS=${TORCH_LINKS:-$([ -d /opt/wheels ] && echo /opt/wheels || echo https://download.pytorch.org/whl/cpu/torch/)}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "$TORCH_PIN+cpu" > "$tmp/torch.txt"
# Tools the install runs with (pip) and builds the package with (--no-build-isolation needs them),
# given on stdin (`-`) so that no temporary path shows in the lock's annotations.
PY=$([ -x .venv/bin/python ] && echo .venv/bin/python || command -v python3)
tools() {
    "$PY" -c 'import tomllib; print("\n".join(["pip", *tomllib.load(open("pyproject.toml", "rb"))["build-system"]["requires"]]))'
}
common=(--universal --python-version 3.11 --generate-hashes --quiet
        --find-links "$TORCH_LINKS" --constraint "$tmp/torch.txt" --no-emit-package torch
        --custom-compile-command "bash scripts/lock.sh")
tools | "$UV" pip compile pyproject.toml - --extra ray "${common[@]}" -o requirements.lock "$@"
# The dev lock: everything with the dev extra, the runtime lock's pins as requirements (so shared
# packages keep its versions), less what requirements.lock already installs.
runtime=($(grep -oE '^[A-Za-z0-9._-]+==' requirements.lock | sed 's/==$//'))
tools | "$UV" pip compile pyproject.toml - requirements.lock --extra ray --extra dev "${common[@]}" \
    $(printf -- '--no-emit-package %s ' "${runtime[@]}") -o requirements-dev.lock "$@"
echo "lock.sh: requirements.lock $(grep -c '==' requirements.lock) pins, requirements-dev.lock $(grep -c '==' requirements-dev.lock) more"
