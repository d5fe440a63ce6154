"""A real local Ray cluster for the deployment tests: `ray start --head --block` on loopback
with its own temp folder and ports, `serve deploy` of a config dict, `ray list actors`, and a
teardown that leaves no Ray process behind (it kills only this cluster's, never another's)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from tests.e2e.cluster import free_port

BIN = Path(sys.executable).parent
# docs/ray.md: Ray's own servers on 127.0.0.1, no token auth, no usage report.
ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
}


class RayCluster:
    """One head node with `num_cpus` CPUs and no GPU, bound to 127.0.0.1."""

    def __init__(self, num_cpus: int = 2) -> None:
        self.num_cpus = num_cpus
        # Short: Ray's unix sockets live under it (a socket path is at most 107 bytes).
        self.temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
        self.gcs_port, self.dashboard_port = free_port(), free_port()
        self.dashboard = f"http://127.0.0.1:{self.dashboard_port}"
        self.env = {**os.environ, **ENV}
        self.process: subprocess.Popen | None = None

    def start(self, timeout: float = 90.0) -> None:
        ports = {
            "--port": self.gcs_port,
            "--dashboard-port": self.dashboard_port,
            "--dashboard-agent-listen-port": free_port(),
            "--metrics-export-port": free_port(),
            "--ray-client-server-port": free_port(),
        }
        self.process = subprocess.Popen(
            [
                str(BIN / "ray"),
                "start",
                "--head",
                "--block",
                f"--num-cpus={self.num_cpus}",
                "--num-gpus=0",
                "--node-ip-address=127.0.0.1",
                "--dashboard-host=127.0.0.1",
                "--include-dashboard=true",
                "--disable-usage-stats",
                f"--temp-dir={self.temp_dir}",
                *[f"{k}={v}" for k, v in ports.items()],
            ],
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: the teardown kills the group
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, "ray start exited"
            try:
                with urllib.request.urlopen(f"{self.dashboard}/api/version", timeout=2):
                    return
            except OSError:
                time.sleep(0.5)
        raise TimeoutError(f"Ray's dashboard did not answer within {timeout} s")

    def serve(self, *args: str, timeout: float = 120.0) -> str:
        """`serve ARGS -a DASHBOARD`; returns stdout (raises on a non-zero exit)."""
        done = subprocess.run(
            [str(BIN / "serve"), *args, "-a", self.dashboard],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout

    def deploy(self, config: dict[str, Any], path: Path) -> None:
        """Write `config` as a Serve config file at `path` and `serve deploy` it."""
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        self.serve("deploy", str(path))

    def actors(self, class_name: str) -> list[dict[str, Any]]:
        """The live actors of `class_name` (`ray list actors`), each with its pid."""
        done = subprocess.run(
            [
                str(BIN / "ray"),
                "list",
                "actors",
                "--format",
                "json",
                "--address",
                self.dashboard,
                "--filter",
                f"class_name={class_name}",
                "--filter",
                "state=ALIVE",
                "--detail",
            ],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout)

    def stop(self) -> None:
        """Stop the head and every process of this cluster (SIGTERM, then SIGKILL)."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait(timeout=10)
        for pid in _pids_mentioning(self.temp_dir):  # workers outside the group
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def _pids_mentioning(text: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if text in (entry / "cmdline").read_bytes().decode(errors="replace"):
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids
