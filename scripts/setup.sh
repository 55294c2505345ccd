#!/usr/bin/env bash
# Set up specgate in a project-local virtual environment (.venv).
# torch is installed first and pinned (a CPU build on machines without a GPU); if .venv already
# has a torch (e.g. a CUDA build a GPU user installed), it is kept. Everything else comes from the
# lock files (requirements.lock: what the image installs too; requirements-dev.lock: the dev extra).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
if [ ! -x .venv/bin/python ]; then
    echo "creating .venv with $PYTHON"
    "$PYTHON" -m venv .venv
fi
# pip first, at the lock's version, on its own: a pip that replaces itself halfway through a larger
# install may not finish it.
awk '/^pip==/ {keep = 1; print; next} keep && /^[[:space:]]/ {print; next} {keep = 0}' \
    requirements.lock > .venv/pip.lock
.venv/bin/python -m pip install -q --no-deps --require-hashes -r .venv/pip.lock
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    echo "installing torch==2.13.0"
    .venv/bin/python -m pip install -q "torch==2.13.0"
fi
# Everything else at the lock's versions and hashes, nothing resolved here:
# `bash scripts/lock.sh` regenerates the locks. Then specgate itself, built with the locked
# setuptools rather than one fetched for an isolated build.
echo "installing the locked dependencies (requirements.lock, requirements-dev.lock)"
.venv/bin/python -m pip install -q --no-deps --require-hashes -r requirements.lock -r requirements-dev.lock
echo "installing specgate"
.venv/bin/python -m pip install -q --no-deps --no-build-isolation -e .
# A dependency the locks miss, or a torch (say a GPU build) whose requirements disagree with them.
.venv/bin/python -m pip check
# The CPU kernels (workers/model/small_gemm.py) compile on first use (~40 s); build them now, not on the
# first request. Where they cannot run, the engine uses torch's own paths and says why here.
.venv/bin/python -c "
import torch
from workers.model import small_gemm
print(small_gemm.serving_note(torch.float32, torch.device('cpu')))
"
