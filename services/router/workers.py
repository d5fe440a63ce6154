"""The router's view of its workers: prefill and decode addresses, cached channels, round-robin.

Health checks and load-aware picks come later; this pool spreads requests evenly and knows how
many tokens of KV the largest decode worker can hold for one request.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterable

import grpc

from services.common.errors import ServiceUnavailableError
from services.common.pb import common_pb2, worker_pb2_grpc
from services.common.server import GRPC_OPTIONS


CAPACITY_TIMEOUT_S = 5.0
CAPACITY_RETRY_S = 10.0


def check_address(address: str, field: str) -> str:
    """Returns `address` if it looks like HOST:PORT (port 1-65535); ValueError naming `field`."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{field}: expected HOST:PORT, got {address!r}")
    return address


class WorkerPool:
    """Prefill and decode worker addresses (HOST:PORT) with one cached gRPC channel each.

    `pick_prefill()` / `pick_decode()` cycle through their list; they raise
    ServiceUnavailableError when the list is empty. Channels (and stubs) are created on first
    use and shared by every request: gRPC multiplexes concurrent calls over one connection.
    Thread-safe.
    """

    def __init__(self, prefill: Iterable[str], decode: Iterable[str]) -> None:
        self.prefill = [check_address(a, "prefill") for a in prefill]
        self.decode = [check_address(a, "decode") for a in decode]
        self._lock = threading.Lock()
        self._prefill_cycle = itertools.cycle(self.prefill)
        self._decode_cycle = itertools.cycle(self.decode)
        self._channels: dict[str, grpc.Channel] = {}
        self._capacity: dict[str, int] = {}  # address -> tokens of KV one request can hold there
        self._capacity_retry_at: dict[str, float] = {}  # address -> when to ask again after a failure

    def pick_prefill(self) -> str:
        """The next prefill worker's address, round-robin."""
        if not self.prefill:
            raise ServiceUnavailableError("no prefill workers configured")
        with self._lock:
            return next(self._prefill_cycle)

    def pick_decode(self) -> str:
        """The next decode worker's address, round-robin."""
        if not self.decode:
            raise ServiceUnavailableError("no decode workers configured")
        with self._lock:
            return next(self._decode_cycle)

    def channel(self, address: str) -> grpc.Channel:
        """The cached insecure channel to `address` (created on first use; any HOST:PORT)."""
        with self._lock:
            channel = self._channels.get(address)
            if channel is None:
                channel = grpc.insecure_channel(address, options=GRPC_OPTIONS)
                self._channels[address] = channel
            return channel

    def prefill_stub(self, address: str) -> worker_pb2_grpc.PrefillStub:
        return worker_pb2_grpc.PrefillStub(self.channel(address))

    def decode_stub(self, address: str) -> worker_pb2_grpc.DecodeStub:
        return worker_pb2_grpc.DecodeStub(self.channel(address))

    def kv_transfer_stub(self, address: str) -> worker_pb2_grpc.KVTransferStub:
        return worker_pb2_grpc.KVTransferStub(self.channel(address))

    def decode_capacity(self) -> int | None:
        """Most tokens (prompt + output) one request can hold in any decode worker's KV cache:
        num_blocks * block_size from each worker's GetInfo, asked once and cached. None when no
        worker answers (the request then goes ahead; the worker itself refuses what never fits)."""
        capacities = [c for c in (self._worker_capacity(a) for a in self.decode) if c is not None]
        return max(capacities) if capacities else None

    def _worker_capacity(self, address: str) -> int | None:
        if address in self._capacity:
            return self._capacity[address]
        if time.monotonic() < self._capacity_retry_at.get(address, 0.0):
            return None
        try:
            info = self.decode_stub(address).GetInfo(common_pb2.InfoRequest(), timeout=CAPACITY_TIMEOUT_S)
        except grpc.RpcError:  # down, or not a pdserve worker: ask again a little later
            self._capacity_retry_at[address] = time.monotonic() + CAPACITY_RETRY_S
            return None
        self._capacity[address] = info.num_blocks * info.kv_layout.block_size
        return self._capacity[address]

    def close(self) -> None:
        """Closes every cached channel (in-flight calls on them fail with CANCELLED)."""
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            channel.close()
