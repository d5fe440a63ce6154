#!/usr/bin/env bash
# The main job: install, start a local cluster (router + prefill worker + decode worker as separate
# processes on loopback) on the default model, stream the answer to a real chat prompt, stop it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
. .venv/bin/activate
question="${1:-What is the capital of France?}"
log="$(mktemp)"
pdserve serve --port 0 --http-port 0 >"$log" &
serve_pid=$!
trap 'kill -TERM "$serve_pid" 2>/dev/null; wait "$serve_pid" 2>/dev/null; rm -f "$log"' EXIT
for _ in $(seq 1 600); do
    grep -q '^ready ' "$log" && break
    kill -0 "$serve_pid" 2>/dev/null || { echo "pdserve serve exited before it was ready" >&2; exit 1; }
    sleep 0.5
done
grep -q '^ready ' "$log" || { echo "pdserve serve not ready in 300 s" >&2; exit 1; }
ready="$(grep '^ready ' "$log" | head -1)"
echo "$ready"
router="$(python -c 'import json, sys; print(json.loads(sys.argv[1][6:])["router"])' "$ready")"
echo "Q: $question"
pdserve generate --url "$router" --chat "$question" --temperature 0 --max-tokens 64
