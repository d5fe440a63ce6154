"""KV transfer over gRPC: the engine's `KVTransfer` interface between processes.

Pull model (as vLLM's NixlConnector): the prefill worker keeps a request's blocks pinned and
serves them from its `KVTransfer` service; the decode worker's engine calls `pull()`, which
streams the blocks in chunks of at most `chunk_bytes` (4 MiB) of tensor bytes, then
`complete()`, which calls `ReleaseKV` so the prefill worker unpins them.
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
    layout_to_proto,
    tensor_from_bytes,
    tensor_to_bytes,
)
from services.common.pb import worker_pb2, worker_pb2_grpc
from services.common.server import GRPC_OPTIONS
from services.engine.errors import KVTransferError, RequestNotFoundError
from services.engine.kv_cache import KVCacheSpec
from services.engine.kv_transfer.base import KVHandle
from services.engine.kv_transfer.in_memory import InMemoryKVTransfer

logger = logging.getLogger(__name__)

CHUNK_BYTES = 4 * 1024 * 1024
T = TypeVar("T")


class GrpcKVTransfer(InMemoryKVTransfer):
    """Source bookkeeping as in memory; `pull`/`complete` for a remote source go over gRPC.

    `set_source(request_id, address)` tells the destination where a handle's blocks live.
    `zero_block` (test-only fault injection) zeroes one received block, to prove the decode
    worker really computes from the transferred KV.
    """

    def __init__(self, role: str, timeout_s: float = 30.0, zero_block: int | None = None) -> None:
        super().__init__()
        self.role = role
        self.timeout_s = timeout_s
        self.zero_block = zero_block
        self._addresses: dict[str, str] = {}
        self._channels: dict[str, grpc.Channel] = {}
        self._channel_lock = threading.Lock()
        self.pull_seconds: dict[str, float] = {}  # request_id -> seconds its last pull took
        # request_id -> (first block, KV of the blocks from it on) pulled ahead of the engine
        self._prefetched: dict[str, tuple[int, torch.Tensor]] = {}

    def set_source(self, request_id: str, address: str) -> None:
        self._addresses[request_id] = address

    def prefetch(self, handle: KVHandle, first_block: int = 0) -> None:
        """Pull the handle's blocks from `first_block` on now, on the calling thread.

        The decode worker calls this from its RPC thread before the request reaches the engine,
        so a slow or busy prefill worker delays only this request, never the running batch;
        the engine's later `pull` takes the prefetched copy and its `complete` releases the
        source's pin. `first_block`: the blocks before it were in the local prefix cache when
        asked; if some were evicted before admission, `pull` fetches them then, while the pin
        still holds them. Raises KVTransferError.
        """
        if first_block >= len(handle.block_ids):
            return  # the local prefix cache holds every prompt block
        data = self.pull(handle, first_block)
        with self._channel_lock:
            self._prefetched[handle.request_id] = (first_block, data)

    def discard(self, request_id: str) -> None:
        """Drop a prefetched copy the engine never took (the request ended first)."""
        with self._channel_lock:
            self._prefetched.pop(request_id, None)

    def _stub(self, address: str) -> worker_pb2_grpc.KVTransferStub:
        with self._channel_lock:
            if address not in self._channels:
                self._channels[address] = grpc.insecure_channel(address, options=GRPC_OPTIONS)
            return worker_pb2_grpc.KVTransferStub(self._channels[address])

    def pull(self, handle: KVHandle, first_block: int = 0) -> torch.Tensor:
        with self._channel_lock:
            prefetched = self._prefetched.pop(handle.request_id, None)
        if prefetched is not None and prefetched[0] <= first_block:
            return prefetched[1][:, :, first_block - prefetched[0]:]
        if self.is_local(handle):
            return super().pull(handle, first_block)
        address = self._addresses.get(handle.request_id)
        if address is None:
            raise RequestNotFoundError(f"no source address for request {handle.request_id!r}")
        start = time.perf_counter()
        try:
            data = self._pull_remote(handle, address, first_block)
        except grpc.RpcError as exc:
            metrics.KV_TRANSFER_FAILURES.labels(self.role).inc()
            raise KVTransferError(f"pulling KV of {handle.request_id!r} from {address}: {exc.code().name}") from exc
        nbytes = data.numel() * data.element_size()
        self.bytes_transferred += nbytes
        metrics.KV_TRANSFER_BYTES.labels(self.role).inc(nbytes)
        self.pull_seconds[handle.request_id] = time.perf_counter() - start
        metrics.KV_TRANSFER_TIME.labels(self.role).observe(self.pull_seconds[handle.request_id])
        if self.zero_block is not None and self.zero_block < data.shape[2]:
            data[:, :, self.zero_block] = 0
        return data

    def _pull_remote(self, handle: KVHandle, address: str, first_block: int) -> torch.Tensor:
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
            piece = tensor_from_bytes(chunk.data, spec.dtype, shape)
            offset = chunk.block_offset - first_block
            data[:, :, offset : offset + chunk.num_blocks] = piece
        if data is None:
            raise KVTransferError(f"empty KV stream for {handle.request_id!r}")
        return data

    def complete(self, handle: KVHandle) -> None:
        if self.is_local(handle):
            return super().complete(handle)
        address = self._addresses.pop(handle.request_id, None)
        if address is None:
            return
        try:
            self._stub(address).ReleaseKV(worker_pb2.ReleaseKVRequest(request_id=handle.request_id), timeout=5.0)
        except grpc.RpcError as exc:  # the source's lease frees the blocks anyway
            logger.warning("ReleaseKV %s at %s failed: %s", handle.request_id, address, exc.code().name)


class KVTransferServicer(worker_pb2_grpc.KVTransferServicer):
    """Prefill side: streams pinned blocks to decode workers and unpins them on release."""

    def __init__(self, transfer: GrpcKVTransfer, on_engine: Callable[[Callable[[], T]], T], spec: KVCacheSpec,
                 chunk_bytes: int = CHUNK_BYTES) -> None:
        """`on_engine(fn)` runs fn on the engine's thread (EngineLoop.call)."""
        self.transfer = transfer
        self.on_engine = on_engine
        self.layout = layout_to_proto(spec)
        self.chunk_bytes = chunk_bytes

    def PullKV(self, request, context):
        handle, _ = handle_from_proto(request.handle)
        first_block = request.first_block
        # A copy, read on the engine thread: later frees cannot change what we send.
        data = self.on_engine(lambda: self.transfer.pull(handle, first_block))
        block_bytes = data[:, :, :1].numel() * data.element_size()
        per_chunk = max(1, self.chunk_bytes // block_bytes)
        for offset in range(0, data.shape[2], per_chunk):
            piece = data[:, :, offset : offset + per_chunk]
            yield worker_pb2.KVChunk(
                layout=self.layout if offset == 0 else None, block_offset=first_block + offset,
                num_blocks=piece.shape[2], data=tensor_to_bytes(piece),
            )
        metrics.KV_TRANSFER_BYTES.labels(self.transfer.role).inc(data.numel() * data.element_size())

    def ReleaseKV(self, request, context):
        released = self.on_engine(lambda: self.transfer.release(request.request_id))
        return worker_pb2.ReleaseKVResponse(released=released)
