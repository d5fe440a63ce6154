"""The client and the router load no torch and no transformers model code (fresh interpreters)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers.modeling_utils", "transformers.configuration_utils")


def _loaded_after(statement: str) -> dict:
    code = (
        "import json, sys, time\n"
        "start = time.perf_counter()\n"
        f"{statement}\n"
        "seconds = time.perf_counter() - start\n"
        f"heavy = [m for m in {HEAVY!r} if m in sys.modules]\n"
        "print(json.dumps({'heavy': heavy, 'seconds': seconds}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "statement",
    [
        "import services.cli.client",
        "import services.router.server",
        "from services.cli import main as cli; cli._parser().format_help()",
        "import services.config.roles, services.engine",
    ],
)
def test_import_loads_no_torch(statement):
    result = _loaded_after(statement)
    assert result["heavy"] == [], f"{statement!r} loaded {result['heavy']}"


def test_engine_loads_torch_when_first_asked_for():
    result = _loaded_after("import services.engine as e; e.Engine")
    assert "torch" in result["heavy"]
