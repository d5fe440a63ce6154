"""The destination's lease renewals (mixed into `GrpcKVReceiver`): one background thread renews,
at each source, the lease of every request the worker still wants, every third of the shortest
lease any source granted, so two renewals may fail in a row before a lease lapses."""

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


class LeaseRenewal:
    """Expects of its host class: `_lock`, `_peers` ((address, engine_id) -> lease seconds),
    `_addresses` (request_id -> source address, while wanted), `_stop` (an Event) and
    `_channel(address)`."""

    _lock: threading.Lock
    _peers: dict[tuple[str, str], float]
    _addresses: dict[str, str]
    _stop: threading.Event
    _channel: Callable[[str], grpc.Channel]

    def _renew_interval(self) -> float:
        """A third of the shortest lease any source granted: two renewals may fail in a row."""
        with self._lock:
            leases = list(self._peers.values())
        return min([DEFAULT_LEASE_S, *leases]) / 3

    def _renew_loop(self) -> None:
        last = time.monotonic()
        # A tick, so that a shorter lease learned later counts at once.
        while not self._stop.wait(RENEW_TICK_S):
            if time.monotonic() - last >= self._renew_interval():
                last = time.monotonic()
                self.renew_leases()

    def renew_leases(self) -> None:
        """Renew, at each source, the lease of every request this worker still wants."""
        with self._lock:
            by_address: dict[str, list[str]] = {}
            for request_id, address in self._addresses.items():
                by_address.setdefault(address, []).append(request_id)
        for address, request_ids in by_address.items():
            try:
                worker_pb2_grpc.KVTransferStub(self._channel(address)).RenewKVLease(
                    worker_pb2.RenewKVLeaseRequest(request_ids=request_ids),
                    timeout=HANDSHAKE_TIMEOUT_S,
                )
            except grpc.RpcError as exc:  # the pull itself reports a dead source
                count, code = len(request_ids), exc.code().name
                logger.debug("renewing %d leases at %s failed: %s", count, address, code)
