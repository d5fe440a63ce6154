"""A real Redis server for tests: one started from the `redis-server` binary on a free loopback
port (so a test may kill and restart it), else the machine's on 127.0.0.1:6379."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """`url`; `stop()` / `start()` kill and restart an owned server on the same port."""

    def __init__(self) -> None:
        self.binary = shutil.which("redis-server")
        self.port = _free_port() if self.binary else 6379
        self.process: subprocess.Popen | None = None
        self.url = f"redis://127.0.0.1:{self.port}/0"

    @property
    def owned(self) -> bool:
        return self.binary is not None

    def start(self) -> None:
        if not self.owned:
            if not _answers(self.port):
                raise RuntimeError("no redis-server binary and nothing answers on 127.0.0.1:6379")
            return
        self.process = subprocess.Popen(
            [
                self.binary,
                "--bind",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--save",
                "",
                "--appendonly",
                "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while not _answers(self.port):
            if time.monotonic() > deadline or self.process.poll() is not None:
                raise RuntimeError(f"redis-server on port {self.port} did not start")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=10)
            self.process = None
