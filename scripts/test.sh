#!/usr/bin/env bash
# Install, then run the whole test suite (slow tests included; GPU tests skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
. .venv/bin/activate
python -m pytest -q "$@"
