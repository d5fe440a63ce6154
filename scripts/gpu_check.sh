#!/usr/bin/env bash
# The GPU checks, for a bare lent GPU machine (torch, transformers and triton preinstalled, no
# package registry, no venv): what the machine has, the GPU tests (tests/gpu), then the GPU
# benchmark (benchmarks/gpu.py). At most 6 minutes. Writes gpu.json under $OUT if set.
set -uo pipefail
cd "$(dirname "$0")/.."
export TRITON_INTERPRET=0 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python - <<'PY'
import importlib
import torch
print(f"device: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'NO CUDA'}")
for name in ("torch", "transformers", "tokenizers", "triton", "flash_attn", "pytest", "numpy",
             "grpc", "grpc_health", "grpc_reflection", "google.protobuf", "redis"):
    try:
        module = importlib.import_module(name)
        print(f"  {name}: {getattr(module, '__version__', 'present')}")
    except Exception as exc:  # absent, or built for another torch
        print(f"  {name}: absent ({type(exc).__name__})")
PY
if python -c "import pytest" 2>/dev/null; then
    timeout 240 python -m pytest -q -p no:cacheprovider -s tests/gpu
else
    timeout 240 python tests/gpu/test_gpu.py
fi
tests=$?
timeout 150 python benchmarks/gpu.py --out "${OUT:-benchmarks/results}/gpu.json"
bench=$?
echo "gpu_check: tests rc=$tests, benchmark rc=$bench"
[ "$tests" = 0 ] && [ "$bench" = 0 ]
