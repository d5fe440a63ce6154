"""Starting a local cluster for a benchmark: `pdserve serve` on free ports, ready JSON back."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def start_serve(model: str, *flags: str) -> tuple[subprocess.Popen, dict]:
    """Run `pdserve serve --model MODEL --port 0 --no-http FLAGS`; (process, its `ready` JSON).

    Raises RuntimeError if it exits before it is ready. The caller terminates the process.
    """
    command = [
        sys.executable,
        "-m",
        "services.cli.main",
        "serve",
        "--model",
        model,
        "--port",
        "0",
        "--no-http",
        *flags,
    ]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    for line in process.stdout:
        if line.startswith("ready "):
            return process, json.loads(line[len("ready ") :])
    raise RuntimeError(f"pdserve serve exited with {process.wait()} before ready")
