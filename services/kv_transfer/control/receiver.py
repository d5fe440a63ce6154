"""KV transfer between processes, destination side: the engine's `KVReceiver` (the source side
is the prefill worker's `KVSender`, served by `kv_transfer/control/service.py`).

Pull model (as vLLM's NixlConnector): the prefill worker keeps a request's blocks pinned under a
lease and serves them from its `KVTransfer` service. A decode worker handshakes once per prefill
engine (model id and KV layout must match, else FAILED_PRECONDITION on both sides), pulls the
blocks over the data path the handshake chose (`services.kv_transfer.registry`: PullKV chunks of at
most 4 MiB, the source's shared-memory segment, or a torch.distributed group), renews the leases of
every request it still wants from a background thread (every lease/3 seconds), and releases each
request's pin with `ReleaseKV` once its KV has landed: gRPC is every path's control plane. Every
call has a deadline: a stalled source fails the pull with DEADLINE_EXCEEDED after `timeout_s`, a
dead one with UNAVAILABLE.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import torch

from services.common import metrics
from services.common.channels import ChannelCache, release_kv
from services.common.convert import (
    peer_info_from_proto,
    peer_info_to_proto,
)
from services.common.pb import worker_pb2, worker_pb2_grpc
from services.engine.errors import (
    KVHandshakeError,
    KVNotFoundError,
    KVTransferError,
    RequestNotFoundError,
)
from services.kv_transfer.base import DataPath, KVReceiver
from services.kv_transfer.control.lease_renewal import HANDSHAKE_TIMEOUT_S, LeaseRenewer
from services.kv_transfer.control.paths import open_path
from services.kv_transfer.grpc.receiver import GrpcPath
from services.kv_transfer.handle import KVHandle
from services.kv_transfer.handshake import KVPeerInfo, check_compatible
from services.kv_transfer.lease import DEFAULT_LEASE_S
from services.kv_transfer.shared_memory.segment import sweep_dead_segments

RESWEEP_S = 1.0  # seconds after a source was lost, a second sweep of dead segments

logger = logging.getLogger(__name__)


class GrpcKVReceiver(KVReceiver):
    """The destination side of every cross-process backend: control over gRPC, blocks over the
    data path chosen per source under `backend` (the source side is the prefill worker's
    `KVSender`, served by `services.kv_transfer.control.service.KVTransferServicer`).

    `set_source(request_id, address)` tells the destination where a handle's blocks live;
    `forget(request_id)` ends its interest (the RPC that wanted it is over). `pull_chunks`
    streams the KV as it arrives (the decode worker writes each chunk straight into the
    request's reserved blocks). `timeout_s`: the longest one pull may take. `zero_block`
    (test-only fault injection) zeroes one received block, to prove the decode worker really
    computes from the transferred KV.
    """

    def __init__(
        self,
        engine_id: str = "",
        timeout_s: float = 30.0,
        zero_block: int | None = None,
        role: str = "decode",
        backend: str | None = None,
        device: str = "cpu",
    ) -> None:
        """`engine_id`: the local engine's, sent in handshakes; `role`: the metrics label;
        `backend`: the data path (`--kv-transfer-backend`: one of
        `registry.KV_TRANSFER_BACKENDS`; default gRPC); `device`: where the local KV cache
        lives."""
        self.engine_id = engine_id
        self.backend = backend or "grpc"
        self.device = device
        self.role = role
        self.timeout_s = timeout_s
        self.zero_block = zero_block
        self._addresses: dict[str, str] = {}  # request_id -> source address, while wanted
        self._peers: dict[tuple[str, str], float] = {}  # (address, engine_id) -> its lease seconds
        self._paths: dict[tuple[str, str], DataPath] = {}  # (address, engine_id) -> data path
        self._channels = ChannelCache()
        self._lock = threading.Lock()
        self.pull_seconds: dict[str, float] = {}  # request_id -> seconds its last pull took
        self._renewer = LeaseRenewer(
            self._wanted, self._granted, self._channel, name=f"{role}-kv-lease"
        )
        self.bytes_transferred = 0
        # ReleaseKV leaves from here: its gRPC channel thread must not start on the engine thread
        self._releases = ThreadPoolExecutor(1, thread_name_prefix=f"{role}-kv-release")
        self._releases.submit(lambda: None)  # (and neither must this thread)

    # -- destination bookkeeping ---------------------------------------------------------------

    def set_source(self, request_id: str, address: str) -> None:
        with self._lock:
            self._addresses[request_id] = address
        self._renewer.start()

    def forget(self, request_id: str) -> None:
        """Stop renewing the request's lease and forget its timings."""
        with self._lock:
            self._addresses.pop(request_id, None)
            self.pull_seconds.pop(request_id, None)

    def close(self) -> None:
        """Stop the lease renewals, send queued releases, drop data paths, close channels."""
        self._renewer.stop()
        self._releases.shutdown(wait=True)
        with self._lock:
            paths, self._paths = list(self._paths.values()), {}
        for path in paths:
            path.close()
        self._channels.close()

    def _channel(self, address: str) -> grpc.Channel:
        return self._channels.get(address)

    def _wanted(self) -> dict[str, list[str]]:
        """{source address: [request ids still wanted there]}, for the lease renewals."""
        with self._lock:
            by_address: dict[str, list[str]] = {}
            for request_id, address in self._addresses.items():
                by_address.setdefault(address, []).append(request_id)
        return by_address

    def _granted(self) -> list[float]:
        """The lease seconds each source handshaken with granted."""
        with self._lock:
            return list(self._peers.values())

    def renew_leases(self) -> None:
        """Renew now, at each source, the lease of every request still wanted."""
        self._renewer.renew_leases()

    def _failure(
        self, request_id: str, address: str, exc: grpc.RpcError, what: str
    ) -> KVTransferError:
        reason = exc.code().name.lower()
        # Cancelled by this side: not the transfer's fault.
        if exc.code() != grpc.StatusCode.CANCELLED:
            metrics.KV_TRANSFER_FAILURES.labels(self.role, reason).inc()
        message = (
            f"{what} of {request_id!r} from {address}: {exc.code().name} {exc.details() or ''}"
        )
        if exc.code() == grpc.StatusCode.NOT_FOUND:
            return KVNotFoundError(message)
        return KVTransferError(message, reason=reason)

    # -- handshake -----------------------------------------------------------------------------

    def connect(self, handle: KVHandle, local: KVPeerInfo) -> None:
        address = self._address(handle)
        if (address, handle.engine_id) in self._peers:
            return
        model_id, layout = peer_info_to_proto(local)
        request = worker_pb2.KVHandshakeRequest(
            model_id=model_id, layout=layout, engine_id=self.engine_id
        )
        try:
            reply = worker_pb2_grpc.KVTransferStub(self._channel(address)).Handshake(
                request, timeout=HANDSHAKE_TIMEOUT_S
            )
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                metrics.KV_TRANSFER_FAILURES.labels(self.role, "handshake").inc()
                logger.error("%s (answered by %s)", exc.details(), address)
                raise KVHandshakeError(exc.details() or "KV handshake refused") from None
            raise self._failure(handle.request_id, address, exc, "handshake") from None
        try:
            check_compatible(peer_info_from_proto(reply.model_id, reply.layout), local, address)
        except (KVHandshakeError, ValueError) as exc:
            metrics.KV_TRANSFER_FAILURES.labels(self.role, "handshake").inc()
            logger.error("%s", exc)
            raise KVHandshakeError(str(exc)) from None
        if reply.engine_id != handle.engine_id:  # another process now listens at that address
            raise KVNotFoundError(f"{address} is engine {reply.engine_id}, not {handle.engine_id}")
        try:
            path = open_path(
                self.backend,
                reply,
                self._channel(address),
                address,
                local.spec,
                self.device,
                self.timeout_s,
                self.engine_id,
            )
        except KVHandshakeError as exc:  # a forced path this source cannot serve
            metrics.KV_TRANSFER_FAILURES.labels(self.role, "handshake").inc()
            logger.error("KV from %s: %s", address, exc)
            raise KVHandshakeError(f"KV from {address}: {exc}") from None
        key = (address, handle.engine_id)
        with self._lock:  # two first pulls from one source race here: the first path stays
            winner = self._paths.setdefault(key, path)
            self._peers[key] = reply.lease_seconds or DEFAULT_LEASE_S
        if winner is not path:
            path.close()
            return
        logger.info("KV from %s (%s) over %s", address, handle.engine_id, path.name)
        self._lost(address, keep=handle.engine_id)  # a predecessor at this address is gone

    def _path(self, address: str, engine_id: str) -> DataPath:
        """The data path the handshake chose; PullKV for a source not handshaken with."""
        with self._lock:
            path = self._paths.get((address, engine_id))
        return path or GrpcPath(self._channel(address), address, self.timeout_s)

    def _lost(self, address: str, keep: str | None = None) -> None:
        """Forget the engines at `address` but `keep` (it stopped answering, or another engine
        answers there): no mapping keeps a dead worker's segment alive; sweep dead segments."""
        with self._lock:
            gone = {key for key in {**self._paths, **self._peers} if key[0] == address} - {
                (address, keep)
            }
            paths = [self._paths.pop(key) for key in gone if key in self._paths]
            for key in gone:
                self._peers.pop(key, None)
        for path in paths:
            path.close()
        if any(path.name == "shared_memory" for path in paths):
            sweep_dead_segments()
            # The source's connections close before its process is gone (a SIGKILLed process
            # releases its memory, then its sockets, and only then turns zombie): sweep again
            # once it has surely exited, or its segment stays until the next worker starts.
            again = threading.Timer(RESWEEP_S, sweep_dead_segments)
            again.daemon = True
            again.start()

    def _address(self, handle: KVHandle) -> str:
        address = self._addresses.get(handle.request_id)
        if address is None:
            raise RequestNotFoundError(f"no source address for request {handle.request_id!r}")
        return address

    # -- pulls ---------------------------------------------------------------------------------

    def is_ready(self, handle: KVHandle) -> bool:
        """Never: the KV is on the wire. The decode worker pulls it with `pull_chunks` on its
        RPC thread and writes it into the reserved blocks (`Engine.take_reserved(True)`)."""
        return False

    def pull(self, handle: KVHandle, first_block: int = 0) -> list[torch.Tensor]:
        return [piece.clone() for _, piece in self.pull_chunks(handle, first_block)]

    def pull_chunks(
        self,
        handle: KVHandle,
        first_block: int = 0,
        on_call: Callable[[grpc.Call], object] | None = None,
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """(block offset from `first_block`, KV of the next blocks) as each piece arrives,
        [num_layers, 2, n, block_size, num_kv_heads, head_dim], read-only and valid only until
        the next is asked for (a view of a received message, a staging buffer, or the source's
        shared-memory cache, whose copy the path confirms after the last): copy each first.
        Together they cover the handle's blocks from `first_block` on, in order. `on_call(c)`
        gets the path's call as it starts (`c.cancel()` cancels it). Raises KVTransferError
        (the pull failed, stalled past `timeout_s`, was cancelled or was malformed)."""
        if first_block >= len(handle.block_ids):
            return  # the destination's prefix cache holds every block
        address = self._address(handle)
        start, nbytes = time.perf_counter(), 0
        path = self._path(address, handle.engine_id)
        try:
            for offset, piece in path.stream(handle, first_block, on_call):
                if (
                    self.zero_block is not None
                    and offset <= self.zero_block < offset + piece.shape[2]
                ):
                    piece = piece.clone()  # received pieces are read-only
                    piece[:, :, self.zero_block - offset] = 0
                nbytes += piece.numel() * piece.element_size()
                yield offset, piece
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                self._lost(address)
            raise self._failure(handle.request_id, address, exc, "pulling KV") from None
        except KVTransferError as exc:
            if exc.reason == "unavailable":
                self._lost(address)
            raise
        self.bytes_transferred += nbytes
        metrics.KV_TRANSFER_BYTES.labels(self.role, path.name).inc(nbytes)
        self.pull_seconds[handle.request_id] = time.perf_counter() - start
        metrics.KV_TRANSFER_TIME.labels(self.role).observe(self.pull_seconds[handle.request_id])

    def complete(self, handle: KVHandle) -> None:
        """Tell the source to unpin, without waiting (this runs on the engine thread: the call
        leaves from the release thread); a lost message is covered by the lease."""
        with self._lock:
            address = self._addresses.pop(handle.request_id, None)
        if address is None:
            return
        self._releases.submit(release_kv, self._channels.get(address), handle.request_id, address)
