#!/usr/bin/env bash
# The main job: install, start a local cluster (router + prefill worker + decode worker as separate
# processes on loopback) on the default model, stream the answer to a real chat prompt, stop it.
#
# The terminal shows this script's progress lines ("==> ..."), the question and the streamed
# answer; the services' logs go to a file (`pdserve serve --log-file`) whose path is printed, and
# the warnings and errors they log while starting are printed before the question, those they
# log while answering and stopping after the answer. A cluster that fails to start fails the
# script (exit 1) with the last lines it wrote.
# PDSERVE_RUN_LOGS=terminal also shows every service log line on the terminal as it comes (they
# then interleave with the answer: for debugging). PDSERVE_SKIP_INSTALL=1 uses ./.venv as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
say() { printf '==> %s\n' "$*"; }
question="${1:-What is the capital of France?}"
# Warning and error lines of either log format (text or JSON), the supervisor's own errors, and
# Python tracebacks.
problems='( (WARNING|ERROR|CRITICAL) \[|"level": "(WARNING|ERROR|CRITICAL)"|pdserve: (warning|error)|Traceback \()'

if [ "${PDSERVE_SKIP_INSTALL:-0}" = 1 ]; then
    say "using ./.venv as it is (PDSERVE_SKIP_INSTALL=1)"
else
    say "installing pdserve into ./.venv (scripts/install.sh: about a minute the first time, then a few seconds)"
    bash scripts/install.sh
fi
. .venv/bin/activate

# Outside the cluster's start timeout, on every CPU (a worker is pinned to its own).
say "preparing the default model and the CPU kernels (the first time: about 15 s to convert the model, 50 s to compile the kernels)"
python - <<'PY'
from services.engine.config import DEFAULT_MODEL
from services.engine.loader import resolve_model

resolve_model(DEFAULT_MODEL)  # before torch is imported: converts in a quiet child, says so
from services.engine.kernels import load_cpu_kernels  # noqa: E402 - imports torch

load_cpu_kernels()  # says so when it compiles, and why when it cannot
PY

log_dir="${PDSERVE_CACHE_DIR:-$HOME/.cache/pdserve}/logs"
mkdir -p "$log_dir"
# Keep the last 20 runs' logs.
find "$log_dir" -maxdepth 1 -name 'run-*.log' -printf '%T@ %p\n' | sort -rn | tail -n +20 \
    | cut -d' ' -f2- | xargs -r -d '\n' rm -f
log="$log_dir/run-$(date +%Y%m%d-%H%M%S)-$$.log"
ready_out="$(mktemp)"
stderr_out="$(mktemp)" # everything serve writes to stderr: its log lines, and what no logger wrote
serve_pid=""
stop_cluster() {
    if [ -n "$serve_pid" ]; then
        kill -TERM "$serve_pid" 2>/dev/null || true
        wait "$serve_pid" 2>/dev/null || true
        serve_pid=""
    fi
}
cleanup() {
    stop_cluster
    rm -f "$ready_out" "$stderr_out"
}
trap cleanup EXIT
fail() {
    echo "==> error: $1; its last lines:" >&2
    tail -n 30 "$stderr_out" >&2
    if [ -s "$log" ]; then echo "==> all its logs: $log" >&2; fi
    exit 1
}

say "starting a local cluster: router + 1 prefill + 1 decode worker; logs in $log"
start=$SECONDS
if [ "${PDSERVE_RUN_LOGS:-file}" = terminal ]; then
    pdserve serve --port 0 --http-port 0 --log-file "$log" >"$ready_out" 2> >(tee "$stderr_out" >&2) &
else
    pdserve serve --port 0 --http-port 0 --log-file "$log" >"$ready_out" 2>"$stderr_out" &
fi
serve_pid=$!
for _ in $(seq 1 600); do
    grep -q '^ready ' "$ready_out" && break
    kill -0 "$serve_pid" 2>/dev/null || fail "pdserve serve exited before it was ready"
    sleep 0.5
done
grep -q '^ready ' "$ready_out" || fail "pdserve serve was not ready after 300 s"
ready="$(grep '^ready ' "$ready_out" | head -1)"
read -r router http < <(python -c '
import json, sys
info = json.loads(sys.argv[1][len("ready "):])
print(info["router"], info["http"])' "$ready")
say "ready in $((SECONDS - start)) s: gRPC $router, OpenAI HTTP API $http"
found="$(grep -E "$problems" "$log" || true)"
if [ -n "$found" ]; then
    say "the services logged these warnings or errors while starting:"
    printf '%s\n' "$found"
fi

offset=$(stat -c %s "$log")
echo "Q: $question"
printf 'A: '
status=0
pdserve generate --url "$router" --chat "$question" --temperature 0 --max-tokens 64 || status=$?
stop_cluster
found="$(tail -c +"$((offset + 1))" "$log" | grep -E "$problems" || true)"
if [ -n "$found" ]; then
    say "the services logged these warnings or errors while answering (and stopping):"
    printf '%s\n' "$found"
fi
if [ "$status" -ne 0 ]; then
    echo "==> error: pdserve generate failed (exit $status); the services' logs: $log" >&2
    exit "$status"
fi
say "stopped the cluster; its logs: $log"
