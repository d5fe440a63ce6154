#!/usr/bin/env bash
# Install, then run the whole test suite (slow tests included; GPU tests skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
# Redis tests start their own redis-server on a free port; install the Debian package if this
# machine has none (and no server on 127.0.0.1:6379 to fall back on).
if ! command -v redis-server >/dev/null && ! (exec 3<>/dev/tcp/127.0.0.1/6379) 2>/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get install -y -q redis-server >/dev/null || echo "warning: could not install redis-server" >&2
    else
        echo "warning: no redis-server and nothing on 127.0.0.1:6379: the Redis tests will fail" >&2
    fi
fi
# The observability tests run a real Prometheus (and promtool) on loopback: Debian's package.
if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        { apt-get update -q && apt-get install -y -q --no-install-recommends prometheus; } >/dev/null \
            || echo "warning: could not install prometheus" >&2
    else
        echo "warning: no prometheus/promtool: the observability tests will fail" >&2
    fi
fi
. .venv/bin/activate
# The Ray deployment's tests (tests/deploy/test_ray_serve.py) need the optional extra.
if ! python -c "import ray.serve" 2>/dev/null; then
    python -m pip install -q -e '.[ray]'
fi
# Lint and types first: CI fails on them as on a test (ruff rules and mypy settings: pyproject.toml).
ruff check .
ruff format --check .
mypy
python scripts/check_imports.py
python -m pytest -q "$@"
