"""`pdserve serve`'s supervisor: run a local cluster (prefill and decode workers, the router).

Each service is a child process that prints one `ready {json}` stdout line once it accepts
requests. The supervisor starts the workers, waits for their ready lines, starts the router with
their addresses, prints one aggregated ready line and then watches:
- SIGINT/SIGTERM: SIGTERM the router, which drains (up to its `--shutdown-timeout`), then the
  workers; SIGKILL any still alive after its time; exit 0;
- a child that never becomes ready at the first start: stop the rest, exit 1 with its stderr
  tail;
- a child that exits while serving: start it again on the same ports after a backoff
  (`cluster/restarts.py`); one that keeps dying before it is ready stops the cluster (exit 1);
- the supervisor itself killed: every child gets SIGTERM from the kernel (PR_SET_PDEATHSIG).

One thread: a selector loop reads every child's stdout and stderr (so no child ever blocks on a
full pipe) and forwards their lines to our stderr, prefixed with the child's name, and into
`--log-file` when given (`logs.write_line`: one writer, whole lines). Our stdout carries only the
ready line. No helper threads also means forking a child never races one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import time

from services.cluster.children import Child, ChildSpec, Pipes
from services.cluster.launcher import ClusterSpec, child_spec
from services.cluster.prometheus_targets import target_groups, write_targets
from services.cluster.restarts import RestartPolicy, bound_ports, new_engine_identity
from services.common import logs

READY_PREFIX = "ready "
logger = logging.getLogger("pdserve.serve")


class StartError(Exception):
    """A child exited, timed out or printed a bad ready line before it was ready."""


class _Stopped(Exception):
    """SIGINT/SIGTERM arrived while starting."""


class Supervisor:
    """Starts a `ClusterSpec`, prints the aggregated ready line, and stops it all as one.

    `run()` returns the exit status: 0 after SIGINT/SIGTERM, 1 when a child failed to start
    (at first, or `restarts.MAX_START_FAILURES` times in a row after dying while serving).
    """

    def __init__(self, spec: ClusterSpec, restarts: RestartPolicy | None = None) -> None:
        self.spec = spec
        self.restarts = restarts if restarts is not None else RestartPolicy()
        self.children: list[Child] = []
        self._due: dict[str, tuple[float, Child]] = {}  # name -> (restart time, dead child)
        self._ready = False  # the cluster's ready line went out
        self._pipes = Pipes(self._on_line)
        self._env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # ready lines arrive at once
        self._stop_requested = False

    def run(self) -> int:
        handlers = {
            sig: signal.signal(sig, self._request_stop) for sig in (signal.SIGINT, signal.SIGTERM)
        }
        try:
            for line in self.spec.prepare(_say):
                _say(line)
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
            self._ready = True
            status = self._watch()
            if status == 0 and self.spec.prometheus_targets:  # a clean stop: the targets leave
                with contextlib.suppress(OSError):
                    write_targets(self.spec.prometheus_targets, [])
            # (A child that died leaves them: Prometheus sees it down and PdserveServiceDown
            # fires. A cluster that never became ready never touches the file.)
            return status
        finally:
            self._stop_all()
            self.spec.clean_up()
            for sig, handler in handlers.items():
                signal.signal(sig, handler)

    def ready_info(self) -> dict:
        """{"router": HOST:PORT, "http": URL or None, "services": [router, prefill...,
        decode...], "core_ledger": the workers' core ledger file or None}."""
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
            "core_ledger": self.spec.core_ledger,
        }

    def _ordered(self) -> list[Child]:
        """The router, then the prefill workers, then the decode workers (the ready line's
        order)."""
        return [*self._children("router"), *self._children("prefill"), *self._children("decode")]

    def _children(self, role: str) -> list[Child]:
        return [c for c in self.children if c.spec.role == role]

    def _request_stop(self, signum: int, frame: object) -> None:
        self._stop_requested = True

    def _start(self, spec: ChildSpec, replacing: Child | None = None) -> Child:
        """Starts `spec`'s child, in `replacing`'s place when given."""
        child = Child(spec, self._env)
        if replacing is None:
            self.children.append(child)
        else:
            self.children[self.children.index(replacing)] = child
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
        """Serves until SIGINT/SIGTERM (0), restarting children that die; 1 when one keeps
        dying before it is ready."""
        while not self._stop_requested:
            self._pipes.pump(0.2)
            now = time.monotonic()
            for child in list(self.children):
                if child.proc.poll() is None:
                    if child.ready_at is None and now - child.started_at > self.spec.start_timeout:
                        what = f"not ready after {self.spec.start_timeout:g} s"
                        _say(child.describe(what), logging.WARNING)
                        child.proc.kill()  # counted as a failed start once it is reaped
                    continue
                if child.name in self._due:
                    continue
                self._drain(child)
                ready_for = None if child.ready_at is None else now - child.ready_at
                delay = self.restarts.on_exit(child.name, ready_for)
                code = child.proc.returncode
                if delay is None:
                    failures = self.restarts.start_failures(child.name)
                    what = f"exited with code {code}: {failures} starts in a row failed"
                    _say(f"error: {child.describe(what + '; stopping the cluster')}", logging.ERROR)
                    return 1
                what = f"exited with code {code}; restarting it in {delay:g} s"
                _say(f"error: {child.describe(what)}", logging.ERROR)
                self._due[child.name] = (now + delay, child)
            for name, (due, dead) in list(self._due.items()):
                if now >= due:
                    del self._due[name]
                    self._restart(dead)
        return 0

    def _restart(self, dead: Child) -> None:
        """Starts `dead`'s service again on the ports it had bound, in its place, as a new engine
        (`restarts.new_engine_identity`)."""
        spec = dead.spec
        if spec.config is not None:
            config = spec.config
            if dead.info is not None:  # the ports it bound (0 = any)
                config = bound_ports(config, dead.info)
            spec = child_spec(spec.name, spec.role, new_engine_identity(config), spec.env)
        child = self._start(spec, replacing=dead)
        _say(f"{spec.name} restarted (pid {child.proc.pid})")

    def _drain(self, child: Child, limit: float = 1.0) -> None:
        """Read what an exited child left in its pipes (bounded: a grandchild may hold them)."""
        deadline = time.monotonic() + limit
        while self._pipes.is_open(child) and time.monotonic() < deadline:
            self._pipes.pump(0.05)

    def _on_line(self, child: Child, stream: str, line: str) -> None:
        if stream == "stdout" and child.info is None and line.startswith(READY_PREFIX):
            child.info = _parse_ready(line)
            child.bad_ready = None if child.info is not None else line
            if child.info is not None:
                child.ready_at = time.monotonic()
                if self._ready:
                    _say(f"{child.name} is serving again at {child.info['grpc']}")
            return
        if stream == "stderr":
            child.stderr_tail.append(line)
        # A JSON log record names its role and pid itself: relayed as it is, one object a line.
        _log(line if line.startswith('{"') else f"[{child.name}] {line}")

    def _stop_all(self) -> None:
        """SIGTERM the router and wait while it drains (its streams run on the workers, still
        up), then SIGTERM the workers; SIGKILL whatever outlives its time; reap all."""
        alive = [c for c in self.children if c.proc.poll() is None]
        routers = [c for c in alive if c.spec.role == "router"]
        self._stop_group(routers, max([self._stop_time(c) for c in routers], default=0.0))
        self._stop_group([c for c in alive if c not in routers], self.spec.stop_timeout)
        for child in self.children:
            child.proc.wait()
            self._drain(child, limit=0.2)
        self._pipes.close()

    def _stop_time(self, child: Child) -> float:
        """Seconds `child` gets between SIGTERM and SIGKILL: a router's drain
        (`--shutdown-timeout`) and a margin, else the cluster's stop_timeout."""
        http = getattr(child.spec.config, "http", None)
        drain = getattr(http, "shutdown_timeout", None)
        return self.spec.stop_timeout if drain is None else drain + self.spec.stop_timeout

    def _stop_group(self, children: list[Child], timeout: float) -> None:
        for child in children:
            child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while any(c.proc.poll() is None for c in children) and time.monotonic() < deadline:
            self._pipes.pump(0.05)  # keep reading: a child logging on its way out must not block
        for child in children:
            if child.proc.poll() is None:
                _say(
                    f"{child.name} (pid {child.proc.pid}) still running "
                    f"{timeout:g} s after SIGTERM; killing it",
                    logging.WARNING,
                )
                child.proc.kill()


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
    """The supervisor's own message, when `$PDSERVE_LOGGING_LEVEL` lets `level` through: a
    `pdserve: ...` line (`pdserve: warning: ...` for a warning; errors say `error:` themselves),
    or a JSON record with --log-format json (`services/common/logs.py`), as its children's lines
    are."""
    if not logs.lets_through(level):
        return
    if logs.current_format() == "json":
        logger.log(level, "%s", message)
    elif level == logging.WARNING:
        _log(f"pdserve: warning: {message}")
    else:
        _log(f"pdserve: {message}")


def _log(line: str) -> None:
    logs.write_line(line)
