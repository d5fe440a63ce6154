"""A real Prometheus for tests: Debian's `prometheus` binary on a free loopback port, run with a
copy of the shipped deploy/prometheus/ (its alerts.yml unchanged; its prometheus.yml too but for
the scrape, evaluation and file discovery intervals when a test asks for shorter ones) so that the
targets a test's cluster writes land in the copy's targets/ folder."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

SHIPPED = Path(__file__).resolve().parents[1] / "deploy" / "prometheus"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class PrometheusServer:
    """`start()`, `query(expr)`, `alerts()`, `stop()`; `targets_dir` is where file_sd looks."""

    def __init__(self, workdir: Path, interval: str | None = None) -> None:
        """`interval`: scrape, rule evaluation and targets-file refresh every `interval` (a
        Prometheus duration such as "1s") instead of the shipped 5 s, so that a test waits for
        fewer rounds; the rules, queries and discovery are the shipped ones."""
        binary = shutil.which("prometheus")
        if binary is None:
            raise RuntimeError("no prometheus binary: scripts/test.sh installs Debian's package")
        self.binary = binary
        self.config_dir = workdir / "prometheus"
        shutil.copytree(SHIPPED, self.config_dir)
        if interval is not None:
            config = self.config_dir / "prometheus.yml"
            text = config.read_text()
            keys = ("scrape_interval", "evaluation_interval", "refresh_interval")
            for key in keys:
                assert text.count(f"{key}: 5s") == 1, f"shipped prometheus.yml: {key} moved"
                text = text.replace(f"{key}: 5s", f"{key}: {interval}")
            config.write_text(text)
        self.targets_dir = self.config_dir / "targets"
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None
        self.log = workdir / "prometheus.log"

    def start(self, timeout: float = 30.0) -> None:
        self.process = subprocess.Popen(
            [
                self.binary,
                f"--config.file={self.config_dir / 'prometheus.yml'}",
                f"--storage.tsdb.path={self.config_dir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--web.enable-lifecycle",
            ],
            stdout=subprocess.DEVNULL,
            stderr=self.log.open("w"),
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"prometheus exited: {self.log.read_text()[-2000:]}")
            try:
                urllib.request.urlopen(f"{self.url}/-/ready", timeout=1).read()
                return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"prometheus not ready in {timeout} s")

    def _get(self, path: str, **params: str) -> dict:
        url = f"{self.url}{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10) as reply:
            body = json.load(reply)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        """An instant query's result vector (each: {"metric": labels, "value": [t, "v"]})."""
        data = self._get("/api/v1/query", query=expr)
        assert data["resultType"] == "vector", (expr, data["resultType"])
        return data["result"]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict]:
        data = self._get(
            "/api/v1/query_range", query=expr, start=str(start), end=str(end), step=str(step)
        )
        return data["result"]

    def alerts(self) -> list[dict]:
        return self._get("/api/v1/alerts")["alerts"]

    def active_targets(self) -> list[dict]:
        return self._get("/api/v1/targets")["activeTargets"]

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
