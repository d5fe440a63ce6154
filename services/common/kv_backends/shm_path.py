"""The shared-memory data path (same host, CPU workers): the decode worker maps the source's
KV-cache segment read-only once per source (`services/engine/kv_transfer/shm_segment.py`) and,
for each pull, copies the pinned blocks straight out of it into its own reserved blocks, then
confirms with one ConfirmKVCopy call that the transfer is still live (so the blocks stayed
pinned throughout the copy: an optimistic read validated after, as a seqlock reader does)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import grpc
import torch

from services.common.convert import handle_to_proto
from services.common.pb import worker_pb2, worker_pb2_grpc
from services.engine.errors import KVTransferError
from services.engine.kv_cache import KVCacheSpec, block_runs
from services.engine.kv_transfer.handle import KVHandle
from services.engine.kv_transfer.shm_segment import SharedSegment


class SharedMemoryPath:
    """Copies from `segment` (the source's whole cache, mapped read-only), each copy confirmed
    by a ConfirmKVCopy call to `address` over `channel`, bounded by `timeout_s`."""

    name = "shared_memory"

    def __init__(
        self,
        channel: grpc.Channel,
        address: str,
        segment: SharedSegment,
        spec: KVCacheSpec,
        num_blocks: int,
        timeout_s: float,
    ) -> None:
        self.address, self.timeout_s = address, timeout_s
        self.segment = segment
        self.kv = segment.tensor(
            (spec.num_layers, 2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim),
            spec.dtype,
        )
        self._stub = worker_pb2_grpc.KVTransferStub(channel)

    def stream(
        self,
        handle: KVHandle,
        first_block: int,
        on_call: Callable[[grpc.Future], object] | None,
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """(block offset from `first_block`, a view of the source's cache: one run of its
        consecutive blocks) in order, read with no call first; then one ConfirmKVCopy, which
        makes what the caller copied good. A view is valid only until the next is asked for:
        the caller copies each first. Raises grpc.RpcError (NOT_FOUND: the transfer ended
        before the confirmation, so discard the copy), KVTransferError."""
        block_ids = list(handle.block_ids[first_block:])
        self._check_owner(handle)
        if block_ids and max(block_ids) >= self.kv.shape[2]:
            raise KVTransferError(f"block ids of {handle.request_id!r} past the segment")
        offset = 0
        for start, n in block_runs(block_ids):
            yield offset, self.kv[:, :, start : start + n]
            offset += n
        self._check_owner(handle)  # a successor at the address could confirm a stale copy
        confirm = self._stub.ConfirmKVCopy.future(
            worker_pb2.PullKVRequest(
                handle=handle_to_proto(handle, self.address), first_block=first_block
            ),
            timeout=self.timeout_s,
        )
        if on_call is not None:
            on_call(confirm)
        try:
            confirmed = confirm.result()
        except grpc.FutureCancelledError:
            raise KVTransferError(
                f"shared-memory copy of {handle.request_id!r} cancelled", "cancelled"
            ) from None
        if confirmed.num_blocks != len(block_ids):
            raise KVTransferError(
                f"shared-memory copy of {handle.request_id!r}: the source confirmed "
                f"{confirmed.num_blocks} of {len(block_ids)} blocks",
                "failed",
            )

    def _check_owner(self, handle: KVHandle) -> None:
        """KVTransferError ("unavailable": the caller forgets this source and handshakes again)
        when the process that owns the mapped segment is gone: its blocks are no one's now."""
        if not self.segment.owner_alive():
            raise KVTransferError(
                f"shared-memory KV of {handle.request_id!r}: {self.address}'s segment "
                f"{self.segment.name} belongs to a process that is gone (pid "
                f"{self.segment.owner_pid})",
                "unavailable",
            )

    def close(self) -> None:
        """The mapping goes with the last view of it."""
