"""KV transfer over gRPC, source side: the prefill worker's `KVTransfer` service.

It answers handshakes (refusing any model or layout difference), streams a pinned request's
blocks in chunks of at most 4 MiB, each read in place from the cache while the request's lease
holds a pull, renews leases and releases pins (`services/kv_transfer/lease.py`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import grpc
import torch

from services.common import metrics
from services.common.convert import handle_from_proto, peer_info_from_proto, peer_info_to_proto
from services.common.pb import worker_pb2, worker_pb2_grpc
from services.engine.errors import InvalidRequestError, KVHandshakeError
from services.kv_transfer.control.pulls import PullGuard
from services.kv_transfer.cuda_ipc.export import export_cuda_kv
from services.kv_transfer.grpc.wire import encode_chunk
from services.kv_transfer.handshake import KVPeerInfo, mismatches, node_id
from services.kv_transfer.sender import KVSender
from services.kv_transfer.torch_dist.source import GroupServer

logger = logging.getLogger(__name__)

CHUNK_BYTES = 4 * 1024 * 1024


class KVTransferServicer(worker_pb2_grpc.KVTransferServicer):
    """Prefill side: handshakes, streams pinned blocks, renews and releases leases; on one node
    also confirms copies out of its mapped cache (shared memory, CUDA IPC) and serves
    torch.distributed groups (`services/kv_transfer/torch_dist/source.py`).

    `backends`: the data paths offered besides PullKV ("shared_memory" needs the sender to be a
    `SharedMemoryKVSender` with a segment; "torch_dist" builds groups on the backend of
    `device`'s type, where the cache lives, their stores on `dist_host`, every group operation
    bounded by `group_timeout_s`).

    `on_engine(fn)` runs fn on the engine's thread, now or soon, without waiting for it
    (EngineLoop.post): an RPC that frees a pin never holds a server thread while the engine
    steps, so a burst of releases and cancels cannot take every thread from the health service.
    `stall_s` (test-only fault injection, `--debug-kv-stall-seconds`) holds every PullKV that
    long before its first chunk.
    """

    def __init__(
        self,
        sender: KVSender,
        on_engine: Callable[[Callable[[], object]], None],
        peer_info: KVPeerInfo,
        chunk_bytes: int = CHUNK_BYTES,
        stall_s: float = 0.0,
        backends: tuple[str, ...] = (),
        device: str = "cpu",
        dist_host: str = "127.0.0.1",
        group_timeout_s: float = 30.0,
        cuda_kv: torch.Tensor | None = None,
    ) -> None:
        self.sender = sender
        self.on_engine = on_engine
        self.peer_info = peer_info
        self.layout = peer_info_to_proto(peer_info)[1]
        self.block_bytes = peer_info.spec.bytes_per_block
        self.chunk_bytes = chunk_bytes
        self.stall_s = stall_s
        segment = getattr(sender, "segment", None)
        self.segment = segment if "shared_memory" in backends else None
        self.backends = tuple(b for b in backends if b != "shared_memory" or self.segment)
        self.device_type = device.split(":")[0]
        self.dist_device = device if "torch_dist" in backends else None
        self.dist_host, self.group_timeout_s = dist_host, group_timeout_s
        self.cuda_kv = cuda_kv if "cuda_ipc" in backends else None  # the cache, on CUDA
        self.backends = tuple(
            b for b in self.backends if b != "cuda_ipc" or self.cuda_kv is not None
        )
        self._cuda_ipc_export = ""
        self.pulls = PullGuard(sender, on_engine, self.block_bytes, stall_s)
        self.groups = GroupServer(self.pulls, self.dist_device, dist_host, group_timeout_s)

    def Handshake(self, request, context):
        remote = peer_info_from_proto(request.model_id, request.layout)
        diff = mismatches(self.peer_info, remote)  # this worker is the source
        if diff:
            metrics.KV_TRANSFER_FAILURES.labels("prefill", "handshake").inc()
            message = (
                f"KV handshake from {request.engine_id or context.peer()} refused: "
                + "; ".join(diff)
            )
            logger.error("%s", message)
            raise KVHandshakeError(message)
        model_id, layout = peer_info_to_proto(self.peer_info)
        return worker_pb2.KVHandshakeResponse(
            engine_id=self.sender.engine_id,
            model_id=model_id,
            layout=layout,
            lease_seconds=self.sender.leases.lease_s,
            backends=self.backends,
            shared_memory=self._segment_offer(),
            device_type=self.device_type,
            node_id=node_id(),
            cuda_ipc=self._cuda_ipc_offer(),
        )

    def _cuda_ipc_offer(self) -> str:
        """The cache's CUDA IPC export (made once), or "" where cuda_ipc is not served."""
        if self.cuda_kv is not None and not self._cuda_ipc_export:
            self._cuda_ipc_export = export_cuda_kv(self.cuda_kv).to_json()
        return self._cuda_ipc_export

    def _segment_offer(self) -> worker_pb2.SharedKVSegment | None:
        if self.segment is None:
            return None
        return worker_pb2.SharedKVSegment(
            name=self.segment.name,
            token=self.segment.token,
            nbytes=self.segment.nbytes,
            num_blocks=self.segment.nbytes // self.block_bytes,
        )

    def PullKV(self, request, context):
        """Yields serialized KVChunks (`kv_wire.encode_chunk`, straight from the cache): register
        with `add_kv_transfer_servicer`, whose PullKV passes bytes through unserialized.

        Each chunk is read under a pull on the request's lease (its blocks cannot be freed during
        the read) and renews the lease; between chunks the lease runs as usual, so a stream whose
        receiver hangs cannot hold the blocks longer than a lease. Raises RequestNotFoundError
        (NOT_FOUND) once the transfer has ended, before or during the stream."""
        handle, _ = handle_from_proto(request.handle)
        first_block, rid, leases = request.first_block, handle.request_id, self.sender.leases
        source = self.sender.source(handle)
        num_blocks = len(handle.block_ids)
        if not 0 <= first_block < num_blocks:
            raise InvalidRequestError(
                "first_block", f"{first_block} outside the handle's {num_blocks} blocks"
            )
        if not leases.renew(rid):
            leases.begin_pull(rid)  # raises NOT_FOUND, saying how the transfer ended
        self.pulls.stall(context)
        per_chunk = max(1, self.chunk_bytes // self.block_bytes)
        for start in range(first_block, num_blocks, per_chunk):
            if not context.is_active():  # the destination went away
                return
            end = min(start + per_chunk, num_blocks)
            leases.begin_pull(rid)
            try:
                chunk = encode_chunk(
                    start,
                    end - start,
                    self.layout if start == first_block else None,
                    source.kv_buffers(handle, start, end),
                )
            finally:
                self.pulls.end(rid)  # released while we read: freed now
            yield chunk
        metrics.KV_TRANSFER_BYTES.labels("prefill", "grpc").inc(
            (num_blocks - first_block) * self.block_bytes
        )

    def ConfirmKVCopy(self, request, context) -> worker_pb2.ConfirmKVCopyResponse:
        """The receiver copied the handle's blocks out of the mapped cache with no call before:
        they were pinned at publish and a pin ends only with its transfer, so the copy is good
        if the transfer is still live now (an optimistic read validated after, as a seqlock
        reader does), and the handle names the pinned request's own blocks. Raises
        RequestNotFoundError (NOT_FOUND) otherwise."""
        self.pulls.stall(context)
        handle = self.pulls.check(request)
        num_blocks = len(self.sender.source(handle).pinned_blocks(handle, request.first_block))
        # A source maps one kind of cache: its shared-memory segment (CPU) or its GPU memory.
        mapped = "cuda_ipc" if self.cuda_kv is not None else "shared_memory"
        self.pulls.count(mapped, handle, request.first_block)
        return worker_pb2.ConfirmKVCopyResponse(num_blocks=num_blocks)

    def OpenKVGroup(self, request, context):
        return self.groups.open(request, context)

    def SendKV(self, request, context):
        return self.groups.send(request, context)

    def close_groups(self, timeout_s: float = 5.0) -> None:
        """End every torch.distributed group and wait until each is torn down."""
        self.groups.close(timeout_s)

    def RenewKVLease(self, request, context):
        return worker_pb2.RenewKVLeaseResponse(
            renewed=[self.sender.renew(rid) for rid in request.request_ids]
        )

    def ReleaseKV(self, request, context):
        released = self.sender.release(request.request_id, self.on_engine)
        return worker_pb2.ReleaseKVResponse(released=released)


def add_kv_transfer_servicer(servicer: KVTransferServicer, server: grpc.Server) -> None:
    """Register the KVTransfer service; as the generated `add_KVTransferServicer_to_server`, but
    PullKV's messages go out as the bytes `kv_wire.encode_chunk` made (no protobuf copy)."""
    methods: dict[str, grpc.RpcMethodHandler] = {
        "Handshake": grpc.unary_unary_rpc_method_handler(
            servicer.Handshake,
            worker_pb2.KVHandshakeRequest.FromString,
            worker_pb2.KVHandshakeResponse.SerializeToString,
        ),
        "PullKV": grpc.unary_stream_rpc_method_handler(
            servicer.PullKV, worker_pb2.PullKVRequest.FromString, lambda raw: raw
        ),
        "RenewKVLease": grpc.unary_unary_rpc_method_handler(
            servicer.RenewKVLease,
            worker_pb2.RenewKVLeaseRequest.FromString,
            worker_pb2.RenewKVLeaseResponse.SerializeToString,
        ),
        "ReleaseKV": grpc.unary_unary_rpc_method_handler(
            servicer.ReleaseKV,
            worker_pb2.ReleaseKVRequest.FromString,
            worker_pb2.ReleaseKVResponse.SerializeToString,
        ),
        "ConfirmKVCopy": grpc.unary_unary_rpc_method_handler(
            servicer.ConfirmKVCopy,
            worker_pb2.PullKVRequest.FromString,
            worker_pb2.ConfirmKVCopyResponse.SerializeToString,
        ),
        "OpenKVGroup": grpc.unary_stream_rpc_method_handler(
            servicer.OpenKVGroup,
            worker_pb2.KVGroupRequest.FromString,
            worker_pb2.KVGroupInfo.SerializeToString,
        ),
        "SendKV": grpc.unary_stream_rpc_method_handler(
            servicer.SendKV,
            worker_pb2.SendKVRequest.FromString,
            worker_pb2.SendKVStatus.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("pdserve.v1.KVTransfer", methods),)
    )
