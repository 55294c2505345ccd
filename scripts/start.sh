#!/usr/bin/env bash
# Set up, fetch the default model (SmolLM2-135M-Instruct, once) and generate on the demo prompts.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/specgate generate --prompts examples/demo.jsonl --max-tokens 96 "$@"
