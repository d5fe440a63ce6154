"""The router's progress watchdog: a worker call that makes no progress while its worker fails
its health checks is cancelled, so the request moves on instead of waiting for its deadline.

A SIGSTOPped (or wedged) worker keeps its TCP connections open: its streams get no byte and no
error. The health checker notices (`WorkerPool`: HEALTH_FAILURES failed checks) and the
watchdog then cancels every call on that worker that has gone `stall_timeout` seconds without
progress, flagging it `stalled`; the request flow sees the cancelled call, reads the flag, and
migrates (decode) or retries (prefill) elsewhere. A healthy worker's slow stream is left alone.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import grpc

from services.router.flow.cancel import Cancellable

logger = logging.getLogger(__name__)
SCAN_INTERVAL_S = 0.25


class StalledCallError(grpc.RpcError):
    """A call the watchdog cut: code UNAVAILABLE (the worker is down as far as the request is
    concerned), so the prefill's retry takes it like a dead worker's answer."""

    def __init__(self, address: str) -> None:
        super().__init__(address)
        self._details = f"worker {address} made no progress while failing its health checks"

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return self._details


class Watch:
    """One watched call: its worker, when it last made progress, whether it was cut."""

    def __init__(self, address: str, call: Cancellable) -> None:
        self.address = address
        self.call = call
        self.last_progress = time.monotonic()
        self.stalled = False

    def progress(self) -> None:
        """The call delivered something (a token, a reply)."""
        self.last_progress = time.monotonic()


class StallWatchdog:
    """Watches calls on workers; `is_unhealthy(address)` is the pool's verdict. Thread-safe."""

    def __init__(self, is_unhealthy: Callable[[str], bool], stall_timeout: float) -> None:
        self.stall_timeout = stall_timeout
        self._is_unhealthy = is_unhealthy
        self._watches: set[Watch] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="router-watchdog", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()

    @contextmanager
    def watch(self, address: str, call: Cancellable) -> Iterator[Watch]:
        """Watches `call` on the worker at `address` while the block runs."""
        watch = Watch(address, call)
        with self._lock:
            self._watches.add(watch)
        try:
            yield watch
        finally:
            with self._lock:
                self._watches.discard(watch)

    def scan(self) -> list[Watch]:
        """Cancels (and returns) the watched calls stalled on an unhealthy worker."""
        now = time.monotonic()
        with self._lock:
            idle = [
                w
                for w in self._watches
                if not w.stalled and now - w.last_progress >= self.stall_timeout
            ]
        stalled = [w for w in idle if self._is_unhealthy(w.address)]
        for watch in stalled:
            watch.stalled = True
            logger.warning(
                "a call on %s made no progress for %.1f s and the worker fails its health "
                "checks: cancelling it",
                watch.address,
                now - watch.last_progress,
            )
            watch.call.cancel()
        return stalled

    def _loop(self) -> None:
        while not self._stop.wait(SCAN_INTERVAL_S):
            self.scan()
