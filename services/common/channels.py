"""gRPC client side shared by every pdserve process: addresses, one channel cache, ReleaseKV.

The router (to its workers) and the decode worker (to prefill workers' KVTransfer services) both
keep one channel per peer address, created on first use and shared by every call (gRPC
multiplexes concurrent calls over one connection), and both unpin a request's prompt KV at its
prefill worker with a fire-and-forget `ReleaseKV` (a lost message is covered by the lease).
"""

from __future__ import annotations

import logging
import threading

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.pb import worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)

# KV chunks are at most 4 MiB of tensor bytes; leave room for the envelope.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
# A restarted peer is found within ~2 s, not after gRPC's default backoff of up to 120 s.
CHANNEL_OPTIONS = [
    *GRPC_OPTIONS,
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2000),
]
# ReleaseKV runs after the request is over, on its own budget: a prefill worker answers between
# engine steps, which can take seconds.
RELEASE_KV_TIMEOUT_S = 30.0


def check_address(address: str, field: str) -> str:
    """Returns `address` if it looks like HOST:PORT (port 1-65535); ValueError naming `field`."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{field}: expected HOST:PORT, got {address!r}")
    return address


def health_serving(channel: grpc.Channel, timeout_s: float) -> bool:
    """Whether the server behind `channel` answers the standard gRPC health check (service "")
    with SERVING within `timeout_s` seconds; False on any RPC error."""
    try:
        # types-grpcio-health-checking's HealthStub lacks the methods its __init__ adds.
        reply = health_pb2_grpc.HealthStub(channel).Check(  # type: ignore[attr-defined]
            health_pb2.HealthCheckRequest(service=""), timeout=timeout_s
        )
    except grpc.RpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


class ChannelCache:
    """One insecure channel per HOST:PORT, created on first use; thread-safe."""

    def __init__(self) -> None:
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()

    def get(self, address: str) -> grpc.Channel:
        """The cached channel to `address` (any HOST:PORT)."""
        with self._lock:
            channel = self._channels.get(address)
            if channel is None:
                channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
                self._channels[address] = channel
            return channel

    def drop(self, address: str) -> None:
        """Close and forget the channel to `address`, if any (a worker that left)."""
        with self._lock:
            channel = self._channels.pop(address, None)
        if channel is not None:
            channel.close()

    def close(self) -> None:
        """Close every channel (in-flight calls on them fail with CANCELLED)."""
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            channel.close()


def release_kv(channel: grpc.Channel, request_id: str, source: str) -> None:
    """Ask the prefill worker behind `channel` (at `source`, for the log) to unpin a request's
    prompt KV, without waiting; a failure is logged (the worker's lease frees the blocks)."""
    future = worker_pb2_grpc.KVTransferStub(channel).ReleaseKV.future(
        worker_pb2.ReleaseKVRequest(request_id=request_id), timeout=RELEASE_KV_TIMEOUT_S
    )
    future.add_done_callback(lambda done: _log_release_failure(done, request_id, source))


def _log_release_failure(done: grpc.Future, request_id: str, source: str) -> None:
    if done.cancelled() or done.exception() is None:
        return
    exc = done.exception()
    code = exc.code().name if isinstance(exc, grpc.RpcError) else type(exc).__name__
    logger.warning(
        "ReleaseKV(%s) at %s failed: %s (the worker's lease frees the blocks)",
        request_id,
        source,
        code,
    )
