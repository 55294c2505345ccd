#!/usr/bin/env bash
# Set up, fetch the default model (SmolLM2-135M-Instruct, once) and start the gateway on it:
# OpenAI-compatible REST on http://127.0.0.1:8000 (extra arguments go to `specgate serve`).
# A first start prints a development tenant's API key and an admin key; use them as Bearer tokens.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/specgate serve "$@"
