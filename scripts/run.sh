#!/usr/bin/env bash
# The main job: install, then answer a real chat prompt with the default model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
. .venv/bin/activate
pdserve run --chat "${1:-What is the capital of France?}" --max-tokens 64
