"""`pdserve serve`: supervise a local cluster (prefill and decode workers, then the router).

Each service is a child process that prints one `ready {json}` stdout line once it accepts
requests. The supervisor starts the workers, waits for their ready lines, starts the router with
their addresses, prints one aggregated ready line and then watches:
- SIGINT/SIGTERM: SIGTERM every child, SIGKILL any still alive after `stop_timeout`, exit 0;
- a child that exits on its own (or never becomes ready): stop the rest, exit 1 with its stderr
  tail;
- the supervisor itself killed: every child gets SIGTERM from the kernel (PR_SET_PDEATHSIG).

One thread: a selector loop reads every child's stdout and stderr (so no child ever blocks on a
full pipe) and forwards their lines to our stderr, prefixed with the child's name. Our stdout
carries only the ready line. No helper threads also means forking a child never races one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from services.children import Child, ChildSpec, Pipes
from services.common.cluster_config import ClusterConfig
from services.common.config import API_KEY_ENV
from services.common.config_json import to_json
from services.common.logs import ENV as LOG_ENV
from services.placement import PlacementPlan, plan_placement, visible_gpus
from services.prometheus_targets import target_groups, write_targets

READY_PREFIX = "ready "
logger = logging.getLogger("pdserve.serve")


# --- what to start -------------------------------------------------------------------------


@dataclass(frozen=True)
class ClusterSpec:
    """The workers, and how to build the router's command from the workers' gRPC addresses."""

    workers: list[ChildSpec]
    router: Callable[[list[str], list[str]], ChildSpec]  # (prefill addrs, decode addrs) -> spec
    start_timeout: float = 120.0  # seconds for each stage (workers, router) to become ready
    stop_timeout: float = 10.0  # seconds between SIGTERM and SIGKILL
    plan_line: str = ""  # the placement, logged at start
    prometheus_targets: str | None = None  # file_sd file once ready (emptied on a clean stop)
    model: str = ""  # the served model, the targets' `model` label


class StartError(Exception):
    """A child exited, timed out or printed a bad ready line before it was ready."""


class _Stopped(Exception):
    """SIGINT/SIGTERM arrived while starting."""


def _command(role: str, config: Any) -> list[str]:
    """`python -m services.cli ROLE --config-json ...`: the child gets its whole config."""
    return [sys.executable, "-m", "services.cli", role, "--config-json", to_json(config)]


def placement_plan(
    config: ClusterConfig, cpus: list[int] | None = None, environ: Mapping[str, str] = os.environ
) -> PlacementPlan | None:
    """The cluster's placement (None with `placement: none`): over `cpus` (default: the CPUs
    this process may use) and, for a CUDA engine, the visible GPUs. Raises ValueError when
    there are fewer GPUs than workers."""
    if config.placement == "none":
        return None
    gpus = visible_gpus(environ) if config.engine.device == "cuda" else []
    cpus = sorted(os.sched_getaffinity(0)) if cpus is None else cpus
    return plan_placement(cpus, config.num_prefill, config.num_decode, gpus)


def cluster_spec(config: ClusterConfig, plan: PlacementPlan | None = None) -> ClusterSpec:
    """The `pdserve serve` cluster: `num_prefill` + `num_decode` workers, each with the config
    `config.prefill_config(i, plan)` / `config.decode_config(i, plan)` derives (and its GPU as
    CUDA_VISIBLE_DEVICES), then the router pointed at their addresses."""

    pools = (
        ("prefill", config.num_prefill, config.prefill_config, plan.prefill_gpus if plan else ()),
        ("decode", config.num_decode, config.decode_config, plan.decode_gpus if plan else ()),
    )
    workers = []
    for role, count, member, gpus in pools:
        for i in range(count):
            worker = member(i, plan)
            env = {"CUDA_VISIBLE_DEVICES": str(gpus[i])} if gpus else {}
            workers.append(ChildSpec(f"{role}-{i}", role, _command(role, worker), worker, env))

    def router(prefill: list[str], decode: list[str]) -> ChildSpec:
        router_config = config.router_config(prefill, decode, plan)
        # The API key goes through the environment, never the command line (`ps` shows argv).
        key = router_config.api_key
        argv = _command("router", dataclasses.replace(router_config, api_key=None))
        env = {API_KEY_ENV: key} if key else {}
        return ChildSpec("router", "router", argv, router_config, env)

    return ClusterSpec(
        workers,
        router,
        start_timeout=config.start_timeout,
        plan_line=plan.describe() if plan else "placement: none (every process unpinned)",
        prometheus_targets=config.prometheus_targets,
        model=config.engine.model,
    )


# --- the supervisor ------------------------------------------------------------------------


class Supervisor:
    """Starts a `ClusterSpec`, prints the aggregated ready line, and stops it all as one.

    `run()` returns the exit status: 0 after SIGINT/SIGTERM, 1 when a child failed.
    """

    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.children: list[Child] = []
        self._pipes = Pipes(self._on_line)
        self._env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # ready lines arrive at once
        self._stop_requested = False

    def run(self) -> int:
        handlers = {
            sig: signal.signal(sig, self._request_stop) for sig in (signal.SIGINT, signal.SIGTERM)
        }
        try:
            if self.spec.plan_line:
                _say(self.spec.plan_line)
            try:
                self._wait_ready([self._start(spec) for spec in self.spec.workers])
                addresses = {
                    role: [c.ready["grpc"] for c in self._children(role)]
                    for role in ("prefill", "decode")
                }
                self._wait_ready(
                    [self._start(self.spec.router(addresses["prefill"], addresses["decode"]))]
                )
            except _Stopped:
                return 0
            except StartError as exc:
                _say(f"error: {exc}", logging.ERROR)
                return 1
            info = self.ready_info()
            if self.spec.prometheus_targets:
                groups = target_groups(info["services"], self.spec.model)
                write_targets(self.spec.prometheus_targets, groups)
                _say(f"Prometheus targets in {self.spec.prometheus_targets}")
            print(READY_PREFIX + json.dumps(info), flush=True)
            status = self._watch()
            if status == 0 and self.spec.prometheus_targets:  # a clean stop: the targets leave
                with contextlib.suppress(OSError):
                    write_targets(self.spec.prometheus_targets, [])
            # (A child that died leaves them: Prometheus sees it down and PdserveServiceDown
            # fires. A cluster that never became ready never touches the file.)
            return status
        finally:
            self._stop_all()
            for sig, handler in handlers.items():
                signal.signal(sig, handler)

    def ready_info(self) -> dict:
        """{"router": HOST:PORT, "http": URL or None, "services": [router, prefill...,
        decode...]}."""
        services = [
            {
                "role": c.spec.role,
                "name": c.name,
                "grpc": c.ready["grpc"],
                "metrics": c.ready["metrics"],
                "pid": c.ready["pid"] if isinstance(c.ready.get("pid"), int) else c.proc.pid,
            }
            for c in self._ordered()
        ]
        [router] = self._children("router")
        return {
            "router": router.ready["grpc"],
            "http": router.ready.get("http"),
            "services": services,
        }

    def _ordered(self) -> list[Child]:
        """The router, then the prefill workers, then the decode workers (the ready line's
        order)."""
        return [*self._children("router"), *self._children("prefill"), *self._children("decode")]

    def _children(self, role: str) -> list[Child]:
        return [c for c in self.children if c.spec.role == role]

    def _request_stop(self, signum: int, frame: object) -> None:
        self._stop_requested = True

    def _start(self, spec: ChildSpec) -> Child:
        child = Child(spec, self._env)
        self.children.append(child)
        self._pipes.add(child)
        return child

    def _wait_ready(self, children: list[Child]) -> None:
        """Until every child printed its ready line; StartError if one exits or times out first."""
        deadline = time.monotonic() + self.spec.start_timeout
        while pending := [c for c in children if c.info is None]:
            if self._stop_requested:
                raise _Stopped
            for child in pending:
                if child.bad_ready is not None:
                    raise StartError(
                        child.describe(f"printed a bad ready line: {child.bad_ready!r}")
                    )
                if child.proc.poll() is not None:
                    self._drain(child)
                    if child.info is None:
                        code = child.proc.returncode
                        raise StartError(
                            child.describe(f"exited with code {code} before it was ready")
                        )
            if time.monotonic() >= deadline:
                raise StartError(
                    pending[0].describe(f"not ready after {self.spec.start_timeout:g} s")
                )
            self._pipes.pump(0.1)

    def _watch(self) -> int:
        while not self._stop_requested:
            self._pipes.pump(0.2)
            for child in self.children:
                if child.proc.poll() is not None:
                    self._drain(child)
                    code = child.proc.returncode
                    what = f"exited with code {code} while serving; stopping the cluster"
                    _say(f"error: {child.describe(what)}", logging.ERROR)
                    return 1
        return 0

    def _drain(self, child: Child, limit: float = 1.0) -> None:
        """Read what an exited child left in its pipes (bounded: a grandchild may hold them)."""
        deadline = time.monotonic() + limit
        while self._pipes.is_open(child) and time.monotonic() < deadline:
            self._pipes.pump(0.05)

    def _on_line(self, child: Child, stream: str, line: str) -> None:
        if stream == "stdout" and child.info is None and line.startswith(READY_PREFIX):
            child.info = _parse_ready(line)
            child.bad_ready = None if child.info is not None else line
            return
        if stream == "stderr":
            child.stderr_tail.append(line)
        # A JSON log record names its role and pid itself: relayed as it is, one object a line.
        _log(line if line.startswith('{"') else f"[{child.name}] {line}")

    def _stop_all(self) -> None:
        """SIGTERM every live child (router first), SIGKILL after `stop_timeout`, reap all."""
        alive = [c for c in reversed(self.children) if c.proc.poll() is None]
        for child in alive:
            child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.spec.stop_timeout
        while any(c.proc.poll() is None for c in alive) and time.monotonic() < deadline:
            self._pipes.pump(0.05)  # keep reading: a child logging on its way out must not block
        for child in alive:
            if child.proc.poll() is None:
                _say(
                    f"{child.name} (pid {child.proc.pid}) still running "
                    f"{self.spec.stop_timeout:g} s after SIGTERM; killing it"
                )
                child.proc.kill()
        for child in self.children:
            child.proc.wait()
            self._drain(child, limit=0.2)
        self._pipes.close()


def _parse_ready(line: str) -> dict | None:
    """The JSON of a `ready {json}` line, or None unless it names grpc and metrics."""
    try:
        info = json.loads(line[len(READY_PREFIX) :])
    except json.JSONDecodeError:
        return None
    if not isinstance(info, dict) or not all(
        isinstance(info.get(k), str) for k in ("grpc", "metrics")
    ):
        return None
    return info


def _say(message: str, level: int = logging.INFO) -> None:
    """The supervisor's own message: a `pdserve: ...` line, or a JSON record with
    --log-format json (`services/common/logs.py`), as its children's lines are."""
    if os.environ.get(LOG_ENV) == "json":
        logger.log(level, "%s", message)
    else:
        _log(f"pdserve: {message}")


def _log(line: str) -> None:
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):  # our stderr is gone; the children's output has nowhere to go
        pass
