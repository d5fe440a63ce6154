"""`pdserve serve`: supervise a local cluster (prefill and decode workers, then the router).

Each service is a child process that prints one `ready {json}` stdout line once it accepts
requests. The supervisor starts the workers, waits for their ready lines, starts the router with
their addresses, prints one aggregated ready line and then watches:
- SIGINT/SIGTERM: SIGTERM every child, SIGKILL any still alive after `stop_timeout`, exit 0;
- a child that exits on its own (or never becomes ready): stop the rest, exit 1 with its stderr tail;
- the supervisor itself killed: every child gets SIGTERM from the kernel (PR_SET_PDEATHSIG).

One thread: a selector loop reads every child's stdout and stderr (so no child ever blocks on a
full pipe) and forwards their lines to our stderr, prefixed with the child's name. Our stdout
carries only the ready line. No helper threads also means forking a child never races one.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from services.placement import parse_cpu_list

READY_PREFIX = "ready "
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_STDERR_TAIL_LINES = 20


# --- what to start -------------------------------------------------------------------------


@dataclass(frozen=True)
class ChildSpec:
    """One service to start: `argv` must print a `ready {json}` line on stdout when ready."""

    name: str  # "prefill-0", for log prefixes and messages
    role: str  # "router" | "prefill" | "decode"
    argv: list[str]


@dataclass(frozen=True)
class ClusterSpec:
    """The workers, and how to build the router's command from the workers' gRPC addresses."""

    workers: list[ChildSpec]
    router: Callable[[list[str], list[str]], ChildSpec]  # (prefill addrs, decode addrs) -> spec
    start_timeout: float = 120.0  # seconds for each stage (workers, router) to become ready
    stop_timeout: float = 10.0  # seconds between SIGTERM and SIGKILL


def _flags(**values: object) -> list[str]:
    """--flag value pairs for the values that are not None (names: underscores -> dashes)."""
    argv: list[str] = []
    for name, value in values.items():
        if value is not None:
            argv += [f"--{name.replace('_', '-')}", str(value)]
    return argv


def worker_argv(args: argparse.Namespace, role: str) -> list[str]:
    """`python -m services.cli prefill|decode ...` for one worker of `pdserve serve` (free ports)."""
    argv = [sys.executable, "-m", "services.cli", role]
    argv += _flags(
        model=args.model,
        host=args.host,
        port=0,
        metrics_port=0,
        block_size=args.block_size,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        num_blocks=args.num_blocks,
        kv_cache_bytes=args.kv_cache_memory_bytes,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        threads=getattr(args, f"{role}_threads"),
        cpus=getattr(args, f"{role}_cpus"),
    )
    if not args.enable_prefix_caching:
        argv.append("--no-enable-prefix-caching")
    if role == "prefill":
        return argv + _flags(
            kv_lease_seconds=args.kv_lease_seconds,
            redis_url=args.redis_url,
            index_ttl=args.index_ttl,
        )
    return argv + _flags(
        kv_transfer_timeout=args.kv_transfer_timeout,
        max_num_waiting_for_kv=args.max_num_waiting_for_kv,
    )


def router_argv(args: argparse.Namespace, prefill: list[str], decode: list[str]) -> list[str]:
    """`python -m services.cli router ...` pointed at the given worker addresses."""
    argv = [sys.executable, "-m", "services.cli", "router"]
    argv += _flags(
        model=args.model,
        host=args.host,
        port=args.port,
        metrics_port=args.metrics_port,
        request_timeout=args.request_timeout,
        http_port=args.http_port,
        max_model_len=args.max_model_len,
        routing=args.routing,
        redis_url=args.redis_url,
        index_ttl=args.index_ttl,
    )
    for address in prefill:
        argv += ["--prefill", address]
    for address in decode:
        argv += ["--decode", address]
    return argv


def cluster_spec_from_args(args: argparse.Namespace) -> ClusterSpec:
    """The `pdserve serve` cluster; ValueError naming a bad flag before anything starts."""
    for flag in ("num_prefill", "num_decode"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')}: must be >= 1, got {getattr(args, flag)}")
    for role in ("prefill", "decode"):
        threads, cpus = getattr(args, f"{role}_threads"), getattr(args, f"{role}_cpus")
        if threads is not None and threads < 1:
            raise ValueError(f"--{role}-threads: must be >= 1, got {threads}")
        if cpus is not None:
            parse_cpu_list(cpus, flag=f"--{role}-cpus")
    for flag in ("start_timeout", "index_ttl"):
        if not getattr(args, flag) > 0:
            raise ValueError(f"--{flag.replace('_', '-')}: must be > 0, got {getattr(args, flag)}")
    workers = [
        ChildSpec(f"prefill-{i}", "prefill", worker_argv(args, "prefill"))
        for i in range(args.num_prefill)
    ]
    workers += [
        ChildSpec(f"decode-{i}", "decode", worker_argv(args, "decode"))
        for i in range(args.num_decode)
    ]
    return ClusterSpec(
        workers,
        lambda prefill, decode: ChildSpec("router", "router", router_argv(args, prefill, decode)),
        start_timeout=args.start_timeout,
    )


# --- children ------------------------------------------------------------------------------


def _load_prctl() -> Callable[..., int] | None:
    """libc's prctl, resolved in the parent so the forked child only has to call it."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    return libc.prctl


def _child_setup(parent_pid: int) -> Callable[[], None]:
    """Runs in the child between fork and exec: own process group (a terminal's Ctrl-C reaches
    only the supervisor, which stops children in order) and SIGTERM when the supervisor dies."""
    prctl = _load_prctl()

    def setup() -> None:
        os.setpgid(0, 0)
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent_pid:  # the supervisor died before prctl took effect
            os._exit(1)

    return setup


class _Child:
    """A started service: its process, what its ready line said, the tail of its stderr."""

    def __init__(self, spec: ChildSpec, env: dict[str, str]) -> None:
        self.spec = spec
        self.info: dict | None = None  # the JSON of its ready line
        self.bad_ready: str | None = None  # a ready line that did not parse
        self.stderr_tail: deque[str] = deque(maxlen=_STDERR_TAIL_LINES)
        self.proc = subprocess.Popen(
            spec.argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            preexec_fn=_child_setup(os.getpid()),
        )

    @property
    def name(self) -> str:
        return self.spec.name

    def describe(self, what: str) -> str:
        """ "NAME (pid N) WHAT; last stderr lines: ..." for an error message."""
        tail = "".join(f"\n  {line}" for line in self.stderr_tail)
        return f"{self.name} (pid {self.proc.pid}) {what}" + (
            f"; last stderr lines:{tail}" if tail else ""
        )


class StartError(Exception):
    """A child exited, timed out or printed a bad ready line before it was ready."""


class _Stopped(Exception):
    """SIGINT/SIGTERM arrived while starting."""


class _Pipes:
    """Reads children's stdout and stderr line by line, from one thread, without blocking."""

    _MAX_LINE = 1 << 20  # a longer run without a newline is passed on as a line of its own

    def __init__(self, on_line: Callable[[_Child, str, str], None]) -> None:
        self._selector = selectors.DefaultSelector()
        self._partial: dict[int, bytes] = {}
        self._on_line = on_line

    def add(self, child: _Child) -> None:
        self._selector.register(child.proc.stdout, selectors.EVENT_READ, (child, "stdout"))
        self._selector.register(child.proc.stderr, selectors.EVENT_READ, (child, "stderr"))

    def is_open(self, child: _Child) -> bool:
        return any(key.data[0] is child for key in self._selector.get_map().values())

    def pump(self, timeout: float) -> None:
        """Handle every complete line that arrives within `timeout` seconds."""
        if not self._selector.get_map():
            time.sleep(timeout)
            return
        for key, _ in self._selector.select(timeout):
            child, stream = key.data
            data = os.read(key.fd, 65536)
            buffered = self._partial.pop(key.fd, b"") + data
            if not data:  # EOF: the child closed the stream (usually: it exited)
                self._selector.unregister(key.fileobj)
                key.fileobj.close()
                lines = [buffered] if buffered else []
            else:
                *lines, rest = buffered.split(b"\n")
                if len(rest) > self._MAX_LINE:
                    lines.append(rest)
                elif rest:
                    self._partial[key.fd] = rest
            for line in lines:
                self._on_line(child, stream, line.decode(errors="replace").rstrip("\r"))

    def close(self) -> None:
        for key in list(self._selector.get_map().values()):
            self._selector.unregister(key.fileobj)
            key.fileobj.close()
        self._selector.close()


# --- the supervisor ------------------------------------------------------------------------


class Supervisor:
    """Starts a `ClusterSpec`, prints the aggregated ready line, and stops it all as one.

    `run()` returns the exit status: 0 after SIGINT/SIGTERM, 1 when a child failed.
    """

    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.children: list[_Child] = []
        self._pipes = _Pipes(self._on_line)
        self._env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # ready lines arrive at once
        self._stop_requested = False

    def run(self) -> int:
        handlers = {
            sig: signal.signal(sig, self._request_stop) for sig in (signal.SIGINT, signal.SIGTERM)
        }
        try:
            try:
                self._wait_ready([self._start(spec) for spec in self.spec.workers])
                addresses = {
                    role: [c.info["grpc"] for c in self._children(role)]
                    for role in ("prefill", "decode")
                }
                self._wait_ready(
                    [self._start(self.spec.router(addresses["prefill"], addresses["decode"]))]
                )
            except _Stopped:
                return 0
            except StartError as exc:
                _log(f"pdserve: error: {exc}")
                return 1
            print(READY_PREFIX + json.dumps(self.ready_info()), flush=True)
            return self._watch()
        finally:
            self._stop_all()
            for sig, handler in handlers.items():
                signal.signal(sig, handler)

    def ready_info(self) -> dict:
        """{"router": HOST:PORT, "http": URL or None, "services": [router, prefill..., decode...]}."""
        [router] = self._children("router")
        services = [
            {
                "role": c.spec.role,
                "grpc": c.info["grpc"],
                "metrics": c.info["metrics"],
                "pid": c.info["pid"] if isinstance(c.info.get("pid"), int) else c.proc.pid,
            }
            for c in [router, *self._children("prefill"), *self._children("decode")]
        ]
        return {
            "router": router.info["grpc"],
            "http": router.info.get("http"),
            "services": services,
        }

    def _children(self, role: str) -> list[_Child]:
        return [c for c in self.children if c.spec.role == role]

    def _request_stop(self, signum: int, frame: object) -> None:
        self._stop_requested = True

    def _start(self, spec: ChildSpec) -> _Child:
        child = _Child(spec, self._env)
        self.children.append(child)
        self._pipes.add(child)
        return child

    def _wait_ready(self, children: list[_Child]) -> None:
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
                    what = f"exited with code {child.proc.returncode} while serving; stopping the cluster"
                    _log(f"pdserve: error: {child.describe(what)}")
                    return 1
        return 0

    def _drain(self, child: _Child, limit: float = 1.0) -> None:
        """Read what an exited child left in its pipes (bounded: a grandchild may hold them)."""
        deadline = time.monotonic() + limit
        while self._pipes.is_open(child) and time.monotonic() < deadline:
            self._pipes.pump(0.05)

    def _on_line(self, child: _Child, stream: str, line: str) -> None:
        if stream == "stdout" and child.info is None and line.startswith(READY_PREFIX):
            child.info = _parse_ready(line)
            child.bad_ready = None if child.info is not None else line
            return
        if stream == "stderr":
            child.stderr_tail.append(line)
        _log(f"[{child.name}] {line}")

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
                _log(
                    f"pdserve: {child.name} (pid {child.proc.pid}) still running "
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


def _log(line: str) -> None:
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):  # our stderr is gone; the children's output has nowhere to go
        pass
