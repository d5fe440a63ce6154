"""The child processes of `pdserve serve`: how each starts, and one reader for all their pipes.

A child gets its own process group (a terminal's Ctrl-C reaches only the supervisor, which stops
children in order) and SIGTERM from the kernel when the supervisor dies (PR_SET_PDEATHSIG). One
selector loop reads every child's stdout and stderr line by line, so no child ever blocks on a
full pipe, and no helper thread races a fork.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import io
import os
import selectors
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_STDERR_TAIL_LINES = 20


@dataclass(frozen=True)
class ChildSpec:
    """One service to start: `argv` must print a `ready {json}` line on stdout when ready."""

    name: str  # "prefill-0", for log prefixes and messages
    role: str  # "router" | "prefill" | "decode"
    argv: list[str]
    config: Any = None  # the role config `argv` hands the child (RouterConfig, PrefillConfig, ...)
    env: Mapping[str, str] = field(default_factory=dict)  # added to the supervisor's environment


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


class Child:
    """A started service: its process, what its ready line said, the tail of its stderr."""

    def __init__(self, spec: ChildSpec, env: dict[str, str]) -> None:
        self.spec = spec
        self.info: dict | None = None  # the JSON of its ready line
        self.started_at = time.monotonic()
        self.ready_at: float | None = None  # when its ready line arrived
        self.bad_ready: str | None = None  # a ready line that did not parse
        self.stderr_tail: deque[str] = deque(maxlen=_STDERR_TAIL_LINES)
        self.proc = subprocess.Popen(
            spec.argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**env, **spec.env},
            preexec_fn=_child_setup(os.getpid()),
        )

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def ready(self) -> dict:
        """The JSON of its ready line (only once it printed one)."""
        assert self.info is not None, f"{self.name} is not ready"
        return self.info

    def describe(self, what: str) -> str:
        """ "NAME (pid N) WHAT; last stderr lines: ..." for an error message."""
        tail = "".join(f"\n  {line}" for line in self.stderr_tail)
        return f"{self.name} (pid {self.proc.pid}) {what}" + (
            f"; last stderr lines:{tail}" if tail else ""
        )


class Pipes:
    """Reads children's stdout and stderr line by line, from one thread, without blocking."""

    _MAX_LINE = 1 << 20  # a longer run without a newline is passed on as a line of its own

    def __init__(self, on_line: Callable[[Child, str, str], None]) -> None:
        self._selector = selectors.DefaultSelector()
        self._partial: dict[int, bytes] = {}
        self._on_line = on_line

    def add(self, child: Child) -> None:
        assert child.proc.stdout is not None and child.proc.stderr is not None  # PIPEs
        self._selector.register(child.proc.stdout, selectors.EVENT_READ, (child, "stdout"))
        self._selector.register(child.proc.stderr, selectors.EVENT_READ, (child, "stderr"))

    def is_open(self, child: Child) -> bool:
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
                close_pipe(key.fileobj)
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
            close_pipe(key.fileobj)
        self._selector.close()


def close_pipe(pipe: object) -> None:
    """Close a registered pipe (always a child's stdout or stderr file object)."""
    assert isinstance(pipe, io.IOBase)
    pipe.close()
