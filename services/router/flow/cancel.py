"""Cancelling one request: a flag plus the downstream calls in flight.

The transport (the gRPC servicer's `context.add_callback`, or the HTTP handler when its client
goes away) calls `cancel()` from any thread; the request flow registers each downstream call
with `track()`, so a cancel reaches the prefill or decode worker at once instead of when the
flow next looks at the flag.
"""

from __future__ import annotations

import threading
from typing import Protocol, TypeVar

import grpc


class Cancellable(Protocol):
    def cancel(self) -> bool: ...


CallT = TypeVar("CallT", bound=Cancellable)


class RequestCancelledError(grpc.RpcError):
    """The client cancelled (or went away). Carries code CANCELLED, like a cancelled grpc call,
    so `services.common.errors.status_for` maps it without a special case."""

    def __init__(self, details: str = "request cancelled by the client") -> None:
        super().__init__(details)
        self._details = details

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.CANCELLED

    def details(self) -> str:
        return self._details


class CancelScope:
    """A request's cancel flag and its in-flight downstream calls. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cancelled = False
        self._reason: Exception | None = None
        self._calls: list[Cancellable] = []

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def cancel(self, reason: Exception | None = None) -> None:
        """Sets the flag and cancels every tracked call (idempotent; a finished call ignores it).

        `reason`: what the request ends with when the server, not its client, ends it (the
        router shutting down: a ServiceUnavailableError), so it is not reported as a cancel.
        The first cancel's reason stands."""
        with self._lock:
            if not self._cancelled:
                self._reason = reason
            self._cancelled = True
            calls, self._calls = self._calls, []
        for call in calls:
            call.cancel()

    def error(self) -> Exception:
        """What a cancelled request raises: the cancel's reason, else RequestCancelledError."""
        return self._reason if self._reason is not None else RequestCancelledError()

    def track(self, call: CallT) -> CallT:
        """Registers a started call; cancels it at once (and raises) if the scope is cancelled.

        Raises `error()` when the scope was already cancelled.
        """
        with self._lock:
            if not self._cancelled:
                self._calls.append(call)
                return call
        call.cancel()
        raise self.error()

    def untrack(self, call: Cancellable) -> None:
        """Forgets a finished call."""
        with self._lock:
            if call in self._calls:
                self._calls.remove(call)

    def check(self) -> None:
        """Raises `error()` if the scope was cancelled."""
        if self._cancelled:
            raise self.error()
