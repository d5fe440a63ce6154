"""Admission control: a bounded number of sequences in flight, the excess refused at once.

A request takes one unit per sequence it asks for (prompts x n) for its whole life. At most
`capacity() + max_queued` units are in flight, where `capacity()` is what the decode pool runs
at once (the sum of its workers' max_num_seqs, from their GetInfo): the rest of the admitted
ones wait in the pools' queues, and that queue is what `max_queued` bounds. A request that
would go over is refused before any work with `OverloadedError` (RESOURCE_EXHAUSTED / HTTP 429
with Retry-After), never made to wait: as SGLang's `--max-queued-requests`, and as a server
that sheds load has to, so that clients back off instead of piling up.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from services.common import metrics
from services.engine.errors import InvalidRequestError, ResourceExhaustedError

RETRY_AFTER_S = 1  # what a refused client is told to wait (the Retry-After header), seconds


class OverloadedError(ResourceExhaustedError):
    """The router's queue is full (-> RESOURCE_EXHAUSTED / 429 with Retry-After)."""

    retry_after_s = RETRY_AFTER_S


class Ticket:
    """Units held by one admitted request; `release()` (idempotent) gives them back."""

    def __init__(self, gate: AdmissionGate, units: int) -> None:
        self._gate, self.units = gate, units

    def release(self) -> None:
        if self.units:
            self._gate._release(self.units)
            self.units = 0


class AdmissionGate:
    """Counts sequences in flight against `capacity() + max_queued` (thread-safe)."""

    def __init__(
        self,
        capacity: Callable[[], int],
        max_queued: int,
        ceiling: Callable[[], int] | None = None,
    ) -> None:
        self._capacity = capacity
        self._ceiling = ceiling or capacity  # the capacity with every worker healthy
        self.max_queued = max_queued
        self._lock = threading.Lock()
        self.in_flight = 0

    @property
    def limit(self) -> int:
        """Most sequences in flight at once."""
        return self._capacity() + self.max_queued

    def admit(self, units: int = 1) -> Ticket:
        """A ticket for `units` sequences; OverloadedError when they would go over the limit.
        InvalidRequestError naming `n` for more units than the limit could ever be with every
        decode worker healthy: retrying would never help, so that is not a 429."""
        never = self._ceiling() + self.max_queued
        if units > never:
            raise InvalidRequestError(
                "n",
                f"{units} sequences (prompts x n) can never be admitted: the router holds at "
                f"most {never} at once",
            )
        limit = self.limit
        with self._lock:
            if self.in_flight + units > limit:
                metrics.REQUESTS_REJECTED.labels("router", "queue_full").inc()
                raise OverloadedError(
                    f"the router's queue is full ({self.in_flight} sequences in flight, limit "
                    f"{limit}); retry after {RETRY_AFTER_S} s"
                )
            self.in_flight += units
            metrics.SEQUENCES_IN_FLIGHT.labels("router").set(self.in_flight)
        return Ticket(self, units)

    def _release(self, units: int) -> None:
        with self._lock:
            self.in_flight -= units
            metrics.SEQUENCES_IN_FLIGHT.labels("router").set(self.in_flight)
