"""The destination's lease renewals: one background thread renews, at each source, the lease of
every request the decode worker still wants, every third of the shortest lease any source
granted, so two renewals may fail in a row before a lease lapses."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import grpc

from services.common.pb import worker_pb2, worker_pb2_grpc
from services.kv_transfer.lease import DEFAULT_LEASE_S

logger = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 5.0
"""Deadline of each control call (handshake, renewal)."""
RENEW_TICK_S = 0.05


class LeaseRenewer:
    """Renews leases from its own thread, started by the first `start()`.

    `wanted()` gives {source address: [request ids still wanted there]}; `leases()` the lease
    seconds each source granted (a shorter one learned later counts at once); `channel(address)`
    a gRPC channel to a source; `name` the thread's name."""

    def __init__(
        self,
        wanted: Callable[[], dict[str, list[str]]],
        leases: Callable[[], list[float]],
        channel: Callable[[str], grpc.Channel],
        name: str,
    ) -> None:
        self._wanted = wanted
        self._leases = leases
        self._channel = channel
        self._name = name
        self._thread: threading.Thread | None = None
        self._started = threading.Lock()
        self._stop = threading.Event()

    def start(self) -> None:
        """Start the renewal thread (once; later calls do nothing)."""
        with self._started:
            if self._thread is None and not self._stop.is_set():
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()

    def stop(self) -> None:
        """Stop renewing (the thread ends within a tick)."""
        self._stop.set()

    def interval(self) -> float:
        """A third of the shortest lease any source granted: two renewals may fail in a row."""
        return min([DEFAULT_LEASE_S, *self._leases()]) / 3

    def _run(self) -> None:
        last = time.monotonic()
        # A tick, so that a shorter lease learned later counts at once.
        while not self._stop.wait(RENEW_TICK_S):
            if time.monotonic() - last >= self.interval():
                last = time.monotonic()
                self.renew_leases()

    def renew_leases(self) -> None:
        """Renew, at each source, the lease of every request this worker still wants."""
        for address, request_ids in self._wanted().items():
            try:
                worker_pb2_grpc.KVTransferStub(self._channel(address)).RenewKVLease(
                    worker_pb2.RenewKVLeaseRequest(request_ids=request_ids),
                    timeout=HANDSHAKE_TIMEOUT_S,
                )
            except grpc.RpcError as exc:  # the pull itself reports a dead source
                count, code = len(request_ids), exc.code().name
                logger.debug("renewing %d leases at %s failed: %s", count, address, code)
