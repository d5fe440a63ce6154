"""KV transfer over gRPC: the engine's `KVTransfer` interface between processes.

Pull model (as vLLM's NixlConnector): the prefill worker keeps a request's blocks pinned under a
lease and serves them from its `KVTransfer` service. A decode worker handshakes once per prefill
engine (model id and KV layout must match, else FAILED_PRECONDITION on both sides), pulls the
blocks in chunks of at most `chunk_bytes` (4 MiB) of tensor bytes, renews the leases of every
request it still wants from a background thread (every lease/3 seconds), and releases each
request's pin with `ReleaseKV` once its KV has landed. Every call has a deadline: a stalled
source fails the pull with DEADLINE_EXCEEDED after `timeout_s`, a dead one with UNAVAILABLE.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import grpc
import torch

from services.common import metrics
from services.common.convert import (
    handle_from_proto,
    handle_to_proto,
    layout_from_proto,
    peer_info_from_proto,
    peer_info_to_proto,
    tensor_from_bytes,
    tensor_to_bytes,
)
from services.common.pb import worker_pb2, worker_pb2_grpc
from services.common.server import GRPC_OPTIONS
from services.engine.errors import KVHandshakeError, KVTransferError, RequestNotFoundError
from services.engine.kv_cache import KVCacheSpec
from services.engine.kv_transfer.base import KVHandle
from services.engine.kv_transfer.handshake import KVPeerInfo, check_compatible, mismatches
from services.engine.kv_transfer.in_memory import InMemoryKVTransfer
from services.engine.kv_transfer.lease import DEFAULT_LEASE_S

logger = logging.getLogger(__name__)

CHUNK_BYTES = 4 * 1024 * 1024
HANDSHAKE_TIMEOUT_S = 5.0
RELEASE_TIMEOUT_S = 30.0
RENEW_TICK_S = 0.05  # a prefill worker answers between engine steps, which can take seconds
T = TypeVar("T")


class GrpcKVTransfer(InMemoryKVTransfer):
    """Source bookkeeping (leases) as in memory; the destination side goes over gRPC.

    `set_source(request_id, address)` tells the destination where a handle's blocks live;
    `forget(request_id)` ends its interest (the RPC that wanted it is over). `timeout_s`: the
    longest one pull may take. `zero_block` (test-only fault injection) zeroes one received
    block, to prove the decode worker really computes from the transferred KV.
    """

    def __init__(self, role: str, timeout_s: float = 30.0, lease_s: float = DEFAULT_LEASE_S,
                 zero_block: int | None = None) -> None:
        super().__init__(lease_s)
        self.role = role
        self.timeout_s = timeout_s
        self.zero_block = zero_block
        self._addresses: dict[str, str] = {}  # request_id -> source address, while wanted
        self._peers: dict[tuple[str, str], float] = {}  # (address, engine_id) -> its lease seconds
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()
        self.pull_seconds: dict[str, float] = {}  # request_id -> seconds its last pull took
        # request_id -> (first block, KV of the blocks from it on) pulled ahead of the engine
        self._prefetched: dict[str, tuple[int, torch.Tensor]] = {}
        self._renewer: threading.Thread | None = None
        self._stop = threading.Event()
        self.engine_id = ""  # the local engine's id, learned at register_source

    def register_source(self, engine_id: str, source) -> None:
        super().register_source(engine_id, source)
        self.engine_id = engine_id

    # -- destination bookkeeping ---------------------------------------------------------------

    def set_source(self, request_id: str, address: str) -> None:
        with self._lock:
            self._addresses[request_id] = address
            if self._renewer is None:
                self._renewer = threading.Thread(target=self._renew_loop, name=f"{self.role}-kv-lease", daemon=True)
                self._renewer.start()

    def forget(self, request_id: str) -> None:
        """Stop renewing the request's lease and drop any copy the engine never took."""
        with self._lock:
            self._addresses.pop(request_id, None)
            self._prefetched.pop(request_id, None)
            self.pull_seconds.pop(request_id, None)

    def close(self) -> None:
        """Stop the lease renewals and close every channel."""
        self._stop.set()
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            channel.close()

    def _stub(self, address: str) -> worker_pb2_grpc.KVTransferStub:
        with self._lock:
            if address not in self._channels:
                self._channels[address] = grpc.insecure_channel(address, options=GRPC_OPTIONS)
            return worker_pb2_grpc.KVTransferStub(self._channels[address])

    def _failure(self, request_id: str, address: str, exc: grpc.RpcError, what: str) -> KVTransferError:
        reason = exc.code().name.lower()
        metrics.KV_TRANSFER_FAILURES.labels(self.role, reason).inc()
        return KVTransferError(f"{what} of {request_id!r} from {address}: {exc.code().name} {exc.details() or ''}",
                               reason=reason)

    # -- handshake -----------------------------------------------------------------------------

    def connect(self, handle: KVHandle, local: KVPeerInfo) -> None:
        if self.is_local(handle):
            return super().connect(handle, local)
        address = self._address(handle)
        if (address, handle.engine_id) in self._peers:
            return
        model_id, layout = peer_info_to_proto(local)
        request = worker_pb2.KVHandshakeRequest(model_id=model_id, layout=layout, engine_id=self.engine_id)
        try:
            reply = self._stub(address).Handshake(request, timeout=HANDSHAKE_TIMEOUT_S)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                metrics.KV_TRANSFER_FAILURES.labels(self.role, "handshake").inc()
                raise KVHandshakeError(exc.details() or "KV handshake refused") from None
            raise self._failure(handle.request_id, address, exc, "handshake") from None
        try:
            check_compatible(peer_info_from_proto(reply.model_id, reply.layout), local, address)
        except (KVHandshakeError, ValueError) as exc:
            metrics.KV_TRANSFER_FAILURES.labels(self.role, "handshake").inc()
            logger.error("%s", exc)
            raise KVHandshakeError(str(exc)) from None
        if reply.engine_id != handle.engine_id:  # another process now listens at that address
            raise KVTransferError(f"{address} is engine {reply.engine_id}, not {handle.engine_id}", "not_found")
        with self._lock:
            self._peers[(address, handle.engine_id)] = reply.lease_seconds or DEFAULT_LEASE_S

    def _address(self, handle: KVHandle) -> str:
        address = self._addresses.get(handle.request_id)
        if address is None:
            raise RequestNotFoundError(f"no source address for request {handle.request_id!r}")
        return address

    # -- lease renewal -------------------------------------------------------------------------

    def _renew_interval(self) -> float:
        """A third of the shortest lease any source granted: two renewals may fail in a row."""
        with self._lock:
            leases = list(self._peers.values())
        return min([DEFAULT_LEASE_S, *leases]) / 3

    def _renew_loop(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(RENEW_TICK_S):  # a tick, so a shorter lease learned later counts at once
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
                self._stub(address).RenewKVLease(
                    worker_pb2.RenewKVLeaseRequest(request_ids=request_ids), timeout=HANDSHAKE_TIMEOUT_S
                )
            except grpc.RpcError as exc:  # the pull itself reports a dead source
                logger.debug("renewing %d leases at %s failed: %s", len(request_ids), address, exc.code().name)

    # -- pulls ---------------------------------------------------------------------------------

    def prefetch(self, handle: KVHandle, first_block: int = 0) -> None:
        """Pull the handle's blocks from `first_block` on now, on the calling thread.

        The decode worker calls this from its RPC thread once the engine has reserved the
        request's blocks, so a slow or busy prefill worker delays only this request, never the
        running batch; the engine's later `pull` takes the copy. Raises KVTransferError.
        """
        if first_block >= len(handle.block_ids):
            return  # the local prefix cache holds every prompt block
        data = self._pull_remote(handle, first_block)
        with self._lock:
            if handle.request_id in self._addresses:  # still wanted
                self._prefetched[handle.request_id] = (first_block, data)

    def is_ready(self, handle: KVHandle) -> bool:
        return self.is_local(handle) or handle.request_id in self._prefetched

    def pull(self, handle: KVHandle, first_block: int = 0) -> torch.Tensor:
        with self._lock:
            prefetched = self._prefetched.pop(handle.request_id, None)
        if prefetched is not None and prefetched[0] <= first_block:
            return prefetched[1][:, :, first_block - prefetched[0]:]
        if self.is_local(handle):
            return super().pull(handle, first_block)
        return self._pull_remote(handle, first_block)

    def _pull_remote(self, handle: KVHandle, first_block: int) -> torch.Tensor:
        address = self._address(handle)
        start = time.perf_counter()
        try:
            data = self._stream(handle, address, first_block)
        except grpc.RpcError as exc:
            raise self._failure(handle.request_id, address, exc, "pulling KV") from None
        nbytes = data.numel() * data.element_size()
        self.bytes_transferred += nbytes
        metrics.KV_TRANSFER_BYTES.labels(self.role).inc(nbytes)
        self.pull_seconds[handle.request_id] = time.perf_counter() - start
        metrics.KV_TRANSFER_TIME.labels(self.role).observe(self.pull_seconds[handle.request_id])
        if self.zero_block is not None and self.zero_block < data.shape[2]:
            data[:, :, self.zero_block] = 0
        return data

    def _stream(self, handle: KVHandle, address: str, first_block: int) -> torch.Tensor:
        request = worker_pb2.PullKVRequest(handle=handle_to_proto(handle, address), first_block=first_block)
        num_blocks = len(handle.block_ids) - first_block
        data: torch.Tensor | None = None
        spec: KVCacheSpec | None = None
        for chunk in self._stub(address).PullKV(request, timeout=self.timeout_s):
            if data is None:
                spec = layout_from_proto(chunk.layout)
                shape = (spec.num_layers, 2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
                data = torch.empty(shape, dtype=spec.dtype)
            assert spec is not None
            shape = (spec.num_layers, 2, chunk.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
            offset = chunk.block_offset - first_block
            data[:, :, offset : offset + chunk.num_blocks] = tensor_from_bytes(chunk.data, spec.dtype, shape)
        if data is None:
            raise KVTransferError(f"empty KV stream for {handle.request_id!r}", "not_found")
        return data

    def complete(self, handle: KVHandle) -> None:
        """Tell the source to unpin, without waiting (this runs on the engine thread); a lost
        message is covered by the lease."""
        if self.is_local(handle):
            return super().complete(handle)
        with self._lock:
            address = self._addresses.pop(handle.request_id, None)
        if address is None:
            return
        future = self._stub(address).ReleaseKV.future(
            worker_pb2.ReleaseKVRequest(request_id=handle.request_id), timeout=RELEASE_TIMEOUT_S
        )
        future.add_done_callback(lambda done: _log_release(done, handle.request_id, address))


def _log_release(done: grpc.Future, request_id: str, address: str) -> None:
    if not done.cancelled() and done.exception() is not None:
        logger.warning("ReleaseKV %s at %s failed: %s (the lease frees the blocks)", request_id, address,
                       done.exception().code().name)


class KVTransferServicer(worker_pb2_grpc.KVTransferServicer):
    """Prefill side: handshakes, streams pinned blocks, renews and releases leases.

    `on_engine(fn)` runs fn on the engine's thread (EngineLoop.call). `stall_s` (test-only fault
    injection, `--debug-kv-stall-seconds`) holds every PullKV that long before its first chunk.
    """

    def __init__(self, transfer: GrpcKVTransfer, on_engine: Callable[[Callable[[], T]], T], peer_info: KVPeerInfo,
                 chunk_bytes: int = CHUNK_BYTES, stall_s: float = 0.0) -> None:
        self.transfer = transfer
        self.on_engine = on_engine
        self.peer_info = peer_info
        self.layout = peer_info_to_proto(peer_info)[1]
        self.chunk_bytes = chunk_bytes
        self.stall_s = stall_s

    def Handshake(self, request, context):
        remote = peer_info_from_proto(request.model_id, request.layout)
        diff = mismatches(self.peer_info, remote)  # this worker is the source
        if diff:
            metrics.KV_TRANSFER_FAILURES.labels(self.transfer.role, "handshake").inc()
            message = f"KV handshake from {request.engine_id or context.peer()} refused: " + "; ".join(diff)
            logger.error("%s", message)
            raise KVHandshakeError(message)
        model_id, layout = peer_info_to_proto(self.peer_info)
        return worker_pb2.KVHandshakeResponse(engine_id=self.transfer.engine_id, model_id=model_id, layout=layout,
                                              lease_seconds=self.transfer.leases.lease_s)

    def PullKV(self, request, context):
        handle, _ = handle_from_proto(request.handle)
        first_block = request.first_block
        leases = self.transfer.leases
        leases.begin_pull(handle.request_id)  # NOT_FOUND once released; no lapse while we stream
        try:
            self._stall(context)
            if not context.is_active():  # the destination went away during the stall
                return
            # A copy, read on the engine thread: later frees cannot change what we send.
            data = self.on_engine(lambda: self.transfer.read(handle, first_block))
            block_bytes = data[:, :, :1].numel() * data.element_size()
            per_chunk = max(1, self.chunk_bytes // block_bytes)
            for offset in range(0, data.shape[2], per_chunk):
                piece = data[:, :, offset : offset + per_chunk]
                yield worker_pb2.KVChunk(
                    layout=self.layout if offset == 0 else None, block_offset=first_block + offset,
                    num_blocks=piece.shape[2], data=tensor_to_bytes(piece),
                )
            metrics.KV_TRANSFER_BYTES.labels(self.transfer.role).inc(data.numel() * data.element_size())
        finally:
            leases.end_pull(handle.request_id)

    def _stall(self, context) -> None:
        deadline = time.monotonic() + self.stall_s
        while time.monotonic() < deadline and context.is_active():
            time.sleep(0.05)

    def RenewKVLease(self, request, context):
        return worker_pb2.RenewKVLeaseResponse(renewed=[self.transfer.renew(rid) for rid in request.request_ids])

    def ReleaseKV(self, request, context):
        released = self.on_engine(lambda: self.transfer.release(request.request_id))
        return worker_pb2.ReleaseKVResponse(released=released)
