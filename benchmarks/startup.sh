#!/usr/bin/env bash
# Client start-up and router memory, this tree against a baseline commit, in one run on one venv.
#   bash benchmarks/startup.sh [BASELINE_REF]    (default b6f4ca1: before issue 13's light router)
# Prints, per tree: the median of 5 `import services.cli.client` times, the median of 5 times from
# starting `pdserve generate` to its first request's answer (a refused port answers at once, so
# this is the client's whole start-up), and the router's RSS at ready and after one completion
# (HTTP) and one chat (gRPC) on a local `pdserve serve`, and whether libtorch is mapped in it.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=$ROOT/.venv/bin/python
BASE=$(mktemp -d)
trap 'git -C "$ROOT" worktree remove --force "$BASE" >/dev/null 2>&1 || rm -rf "$BASE"' EXIT
git worktree add -q --detach "$BASE" "${1:-b6f4ca1}"
median() { sort -n | sed -n 3p; }
for tree in "$BASE" "$ROOT"; do
  cd "$tree"
  imp=$(for _ in 1 2 3 4 5; do PYTHONPATH=$tree $PY -c \
    "import time; t=time.perf_counter(); import services.cli.client; print(time.perf_counter()-t)"; done | median)
  gen=$(for _ in 1 2 3 4 5; do PYTHONPATH=$tree $PY -c "import subprocess, sys, time; t=time.perf_counter(); \
subprocess.run([sys.executable, '-m', 'services.cli.main', 'generate', '--url', '127.0.0.1:1', '--prompt', 'hi', \
'--timeout', '5'], capture_output=True); print(time.perf_counter()-t)"; done | median)
  out=$(mktemp)
  PYTHONPATH=$tree $PY -m services.cli.main serve --port 0 --http-port 0 >"$out" 2>/dev/null &
  serve=$!
  for _ in $(seq 600); do grep -q '^ready' "$out" && break; sleep 0.5; done
  read -r router http pid <<<"$($PY -c "import json; d=json.loads(open('$out').readline()[6:]); \
print(d['router'], d['http'], [s['pid'] for s in d['services'] if s['role']=='router'][0])")"
  before=$(awk '/VmRSS/ {print $2}' "/proc/$pid/status")
  curl -s "$http/v1/completions" -H 'content-type: application/json' \
    -d '{"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}' >/dev/null
  PYTHONPATH=$tree $PY -m services.cli.main generate --url "$router" --chat "Say hi." --max-tokens 8 >/dev/null
  after=$(awk '/VmRSS/ {print $2}' "/proc/$pid/status")
  torch=$(grep -c libtorch "/proc/$pid/maps" || true)
  kill -TERM "$serve"; wait "$serve" 2>/dev/null || true; rm -f "$out"
  printf '%s: import services.cli.client %.3f s; generate start to first answer %.3f s; router RSS %d -> %d MiB; libtorch mappings %s\n' \
    "$(git -C "$tree" rev-parse --short HEAD)" "$imp" "$gen" $((before / 1024)) $((after / 1024)) "$torch"
done
