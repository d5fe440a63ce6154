"""A running router never loads torch, even when it must convert the default model first; and
workers started in-process from their config objects serve it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from services.config.roles import DecodeConfig, PrefillConfig
from services.decode.server import start_decode
from services.engine.config import EngineConfig
from services.prefill.server import start_prefill
from tests.e2e.cluster import generate, generation_stub

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
# Runs `pdserve router ...` in this interpreter; once it has stopped (SIGTERM), writes which
# heavy modules the process had loaded while it served.
ROUTER = (
    "import json, sys\n"
    "from services.cli import main as cli\n"
    "code = cli.main(sys.argv[2:])\n"
    "heavy = [m for m in ('torch', 'transformers.modeling_utils', 'ray') if m in sys.modules]\n"
    "open(sys.argv[1], 'w').write(json.dumps(heavy))\n"
    "sys.exit(code)\n"
)


def _ready(process: subprocess.Popen, timeout: float = 240) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            raise RuntimeError(f"router exited with {process.wait()} before ready")
        if line.startswith("ready "):
            return json.loads(line[len("ready ") :])
    raise RuntimeError("router not ready in time")


def test_router_with_an_empty_cache_serves_without_torch(tmp_path):
    cache = tmp_path / "cache"
    report = tmp_path / "heavy.json"
    argv = [
        "router",
        "--disaggregation",
        "always",
        "--port",
        "0",
        "--http-port",
        "0",
    ]  # no workers named: they join at run time, on ports of their own (no port race)
    router = subprocess.Popen(
        [sys.executable, "-c", ROUTER, str(report), *argv],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PDSERVE_CACHE_DIR": str(cache), "PYTHONUNBUFFERED": "1"},
    )
    workers = []
    try:
        ready = _ready(router)  # the router converted the model (in a child process)
        folder = cache / "models" / "smollm2-135m-instruct"
        assert (folder / "model.safetensors").is_file()
        engine = EngineConfig(model=str(folder), num_blocks=256)
        join = (ready["grpc"],)
        workers = [
            start_prefill(PrefillConfig(engine=engine, register_with=join)),
            start_decode(DecodeConfig(engine=engine, register_with=join)),
        ]
        body = json.dumps(
            {"prompt": "The capital of France is", "max_tokens": 5, "temperature": 0}
        ).encode()
        deadline = time.monotonic() + 30
        while True:  # the router finds the new workers at its next health check
            try:
                request = urllib.request.Request(
                    f"{ready['http']}/v1/completions", body, {"content-type": "application/json"}
                )
                completion = json.loads(urllib.request.urlopen(request, timeout=60).read())
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        assert completion["usage"]["completion_tokens"] == 5
        _, text, finish = generate(
            generation_stub(ready["grpc"]),
            chat={"messages": [{"role": "user", "content": "Say hi."}]},
            sampling={"max_tokens": 8, "temperature": 0.0},
        )
        assert text and finish in ("stop", "length")
        status = open(f"/proc/{ready['pid']}/status").read()
        rss_kib = int(
            next(line for line in status.splitlines() if line.startswith("VmRSS")).split()[1]
        )
        print(f"router RSS after serving: {rss_kib / 1024:.0f} MiB")
    finally:
        router.terminate()
        code = router.wait(timeout=30)
        for worker in workers:
            worker.stop()
    assert code == 0
    assert json.loads(report.read_text()) == [], "the router loaded torch or transformers models"
