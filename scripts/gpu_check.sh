#!/usr/bin/env bash
# The GPU checks, for a bare lent GPU machine (torch, transformers, triton and pytest
# preinstalled; no package registry, no venv, no model weights): what the machine has, the GPU
# tests (tests/gpu), then the GPU benchmark (benchmarks/gpu.py), phase by phase.
#
#   bash scripts/gpu_check.sh [PHASE...]   # default: all of them, at most 4 minutes
#
# PHASE: probe, tests (= tests-greedy tests-graphs tests-ipc tests-memory tests-attention),
# bounds, llama-1b, llama-8b, ipc, report (a rerun can name only what failed;
# name `bounds` with a benchmark phase: its ratios need the bounds of the same run).
# Every phase runs under its own `timeout` (LIMIT below; about 4 minutes in all on an H200). What it writes,
# as it goes, under $OUT (else benchmarks/results/gpu-run): probe.log, tests.log,
# bench.log, gpu.json (each benchmark phase adds its figures when it has them), summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/gpu-run}
PY=${PYTHON:-python3}  # the lent image's python3 holds torch
mkdir -p "$OUT"
# Packages the lent image lacks or has too old, carried as wheels in .whl/ (the device tool's
# README): grpcio >= the committed stubs' 1.85.1 (the image had 1.84.0). Made here with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --platform manylinux2014_x86_64 -d .whl grpcio==1.85.1
# and carried with the run (carry: [".whl"]); without them the CudaIpcPath test skips, named.
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/gpu_check_site .whl/*.whl && export PYTHONPATH="/tmp/gpu_check_site"
fi
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
PHASES=("$@")
[ ${#PHASES[@]} -eq 0 ] && PHASES=(probe tests bounds llama-1b llama-8b ipc report)
TEST_FILES=(greedy graphs ipc memory attention)  # cheapest must-shows first; FlexAttention compiles last
expanded=()
for phase in "${PHASES[@]}"; do
    if [ "$phase" = tests ]; then expanded+=("${TEST_FILES[@]/#/tests-}"); else expanded+=("$phase"); fi
done
PHASES=("${expanded[@]}")
# Seconds per phase; GPU_CHECK_LIMITS="tests-attention=200 probe=30" overrides some for a rerun.
declare -A LIMIT=([probe]=30 [tests-greedy]=40 [tests-graphs]=40 [tests-ipc]=45 [tests-memory]=30
    [tests-attention]=90 [bounds]=20 [llama-1b]=45 [llama-8b]=55 [ipc]=20 [report]=10)
for pair in ${GPU_CHECK_LIMITS:-}; do LIMIT[${pair%%=*}]=${pair#*=}; done
declare -A RESULT=()
started=$SECONDS

run_phase() {  # name, log file, command...: runs it under its limit, records rc and seconds
    local name=$1 log=$2 begin=$SECONDS rc
    shift 2
    echo "=== $name (limit ${LIMIT[$name]} s) ===" | tee -a "$log"
    timeout -k 5 "${LIMIT[$name]}" "$@" 2>&1 | tee -a "$log"
    rc=${PIPESTATUS[0]}
    local took=$((SECONDS - begin))
    case $rc in
        0) RESULT[$name]="ok (${took} s)" ;;
        124 | 137) RESULT[$name]="TIMED OUT after ${took} s (limit ${LIMIT[$name]} s)" ;;
        *) RESULT[$name]="FAILED rc=$rc (${took} s)" ;;
    esac
    echo "=== $name: ${RESULT[$name]} ===" | tee -a "$log"
}

probe() {
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv || true
    "$PY" - <<'PY'
import importlib
import time
import torch
print(f"device: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'NO CUDA'}")
for name in ("torch", "transformers", "tokenizers", "safetensors", "triton", "flash_attn",
             "pytest", "pytest_timeout", "numpy", "google.protobuf", "grpc", "grpc_health",
             "redis"):
    start = time.perf_counter()
    try:
        module = importlib.import_module(name)
        found = getattr(module, "__version__", "present")
    except Exception as exc:  # absent, or built for another torch
        found = f"absent ({type(exc).__name__}: {exc})"[:140]
    print(f"  {name}: {found} [import {time.perf_counter() - start:.1f} s]", flush=True)
PY
}

for phase in "${PHASES[@]}"; do
    case $phase in
        probe) run_phase probe "$OUT/probe.log" bash -c "PY=$PY; $(declare -f probe); probe" ;;
        tests-*)
            # One pytest per file, each under its own limit, so a hang or a slow compile in one
            # cannot hide the others' results; pytest-timeout (on the lent image) also bounds
            # each test and prints where a hung one was.
            per_test=()
            "$PY" -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout=$((LIMIT[$phase] - 5 < 75 ? LIMIT[$phase] - 5 : 75)))
            file=tests/gpu/test_${phase#tests-}.py
            [ "$phase" = tests-graphs ] && file=tests/gpu/test_cuda_graphs.py
            [ "$phase" = tests-ipc ] && file=tests/gpu/test_cuda_ipc.py
            run_phase "$phase" "$OUT/tests.log" "$PY" -m pytest -p no:cacheprovider -q -rA -s \
                --tb=short --durations=5 "${per_test[@]}" "$file"
            ;;
        bounds | llama-1b | llama-8b | ipc | report)
            run_phase "$phase" "$OUT/bench.log" "$PY" benchmarks/gpu.py --phase "$phase" \
                --out "$OUT/gpu.json"
            ;;
        *) echo "gpu_check: unknown phase $phase" >&2 ;;
    esac
done

{
    echo "=== gpu_check summary ($((SECONDS - started)) s in all) ==="
    for phase in "${PHASES[@]}"; do
        echo "  $phase: ${RESULT[$phase]:-not run}"
    done
    if [ -f "$OUT/tests.log" ]; then
        echo "tests/gpu:"
        grep -E "^(PASSED|FAILED|ERROR|SKIPPED|XFAIL)|[0-9]+ (passed|failed|skipped|error)" \
            "$OUT/tests.log" | sed 's/^/  /'
    fi
    if [ -f "$OUT/gpu.json" ]; then
        echo "benchmarks/gpu.py:"
        "$PY" -c 'import json, sys; print("\n".join("  " + line for line in json.load(open(sys.argv[1])).get("summary", [])))' "$OUT/gpu.json"
    fi
} | tee "$OUT/summary.txt"
failed=0
for phase in "${PHASES[@]}"; do
    [[ ${RESULT[$phase]:-} == ok* ]] || failed=1
done
exit $failed
