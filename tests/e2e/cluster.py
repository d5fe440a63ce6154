"""Start and stop real pdserve processes for end-to-end tests."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc
from prometheus_client.parser import text_string_to_metric_families

from services.common.pb import common_pb2, generate_pb2, generate_pb2_grpc, worker_pb2_grpc

START_TIMEOUT_S = 180


@dataclass
class Proc:
    """A started pdserve command and the JSON of its `ready` line."""

    process: subprocess.Popen
    ready: dict
    pids: list[int] = field(default_factory=list)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        return self.process.wait(timeout=timeout)


def start(*args: str, stderr: Any = None) -> Proc:
    """Run `pdserve ARGS`, wait for its `ready {json}` line (raises RuntimeError if it dies
    first). `stderr`: where its logs go (a file; default: the test's stderr)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "services.cli.main", *args],
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            raise RuntimeError(
                f"pdserve {' '.join(args)} exited with {process.wait()} before ready"
            )
        if line.startswith("ready "):
            ready = json.loads(line[len("ready ") :])
            pids = [s["pid"] for s in ready.get("services", [])] or [ready["pid"]]
            return Proc(process, ready, pids)
    process.kill()
    raise RuntimeError(f"pdserve {' '.join(args)} not ready in {START_TIMEOUT_S} s")


def start_all(*commands: list[str]) -> list[Proc]:
    """`start` several commands at once (each `pdserve ARGS` as a list); in the given order."""
    with ThreadPoolExecutor(len(commands)) as pool:
        return list(pool.map(lambda args: start(*args), commands))


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); treat it as gone.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def scrape(url: str, name: str, role: str, **labels: str) -> float:
    """The sum of a `pdserve_*` metric's samples (the full sample name, `_total` included) whose
    labels include role=`role` and `labels`, from a /metrics endpoint; KeyError if none."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    want = {"role": role, **labels}
    found = [
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and want.items() <= sample.labels.items()
    ]
    if not found:
        raise KeyError(f"{name} {want} not in {url}")
    return sum(found)


def generation_stub(address: str) -> generate_pb2_grpc.GenerationStub:
    return generate_pb2_grpc.GenerationStub(grpc.insecure_channel(address))


def worker_info(address: str, role: str) -> common_pb2.WorkerInfo:
    channel = grpc.insecure_channel(address)
    stub = (
        worker_pb2_grpc.PrefillStub(channel)
        if role == "prefill"
        else worker_pb2_grpc.DecodeStub(channel)
    )
    return stub.GetInfo(common_pb2.InfoRequest(), timeout=10)


def generate(stub, timeout: float = 120, **request) -> tuple[list[int], str, str]:
    """(token ids, text, finish_reason) of one streamed Generate call."""
    token_ids, text, finish = [], "", ""
    for msg in stub.Generate(generate_pb2.GenerateRequest(**request), timeout=timeout):
        token_ids += list(msg.token_ids)
        text += msg.text
        finish = msg.finish_reason or finish
    return token_ids, text, finish


FIXED_PORTS_FROM = 20000  # free_port's range starts here (below it: services a machine runs)


def free_port() -> int:
    """A loopback port that was free a moment ago (for configs that name their ports), from
    below the kernel's ephemeral range when it leaves room: every port-0 bind and outbound
    connection takes its port from that range, so none can take this one before the config's
    process binds it (or binds it again after a restart)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 0
    rng = random.Random()
    for _ in range(100 if ephemeral_low > FIXED_PORTS_FROM + 1000 else 0):
        port = rng.randrange(FIXED_PORTS_FROM, ephemeral_low)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
