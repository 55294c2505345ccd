#!/usr/bin/env bash
# Set up specgate in a project-local virtual environment (.venv).
# torch is installed first and pinned (a CPU build on machines without a GPU); if .venv already
# has a torch (e.g. a CUDA build a GPU user installed), it is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
if [ ! -x .venv/bin/python ]; then
    echo "creating .venv with $PYTHON"
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    echo "installing torch==2.13.0"
    .venv/bin/python -m pip install -q "torch==2.13.0"
fi
echo "installing specgate with its dev extras"
.venv/bin/python -m pip install -q -e ".[dev]"
# The CPU kernels (workers/small_gemm.py) compile on first use (~40 s); build them now, not on the
# first request. Where they cannot run, the engine uses torch's own paths and says why here.
.venv/bin/python -c "
import torch
from workers import small_gemm
ok = small_gemm.available(torch.float32)
print('CPU kernels:', 'built' if ok else 'not used (' + str(small_gemm.unavailable_reason) + ')')
"
