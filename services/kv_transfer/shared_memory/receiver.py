"""The shared-memory data path, receiver side, and what every mapped-cache path shares: the decode
worker maps the source's whole KV cache once per source and, for each pull, copies the pinned
blocks straight out of it into its own reserved blocks, then confirms with one ConfirmKVCopy call
that the transfer is still live (so the blocks stayed pinned throughout the copy: an optimistic
read validated after, as a seqlock reader does). The CUDA IPC path
(`services/kv_transfer/cuda_ipc/receiver.py`) is a `MappedCachePath` too."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import grpc
import torch

from services.common.convert import handle_to_proto
from services.common.pb import worker_pb2, worker_pb2_grpc
from services.engine.errors import KVTransferError
from services.engine.kv_cache import KVCacheSpec, block_runs
from services.kv_transfer.handle import KVHandle
from services.kv_transfer.shared_memory.segment import SharedSegment, pid_alive


class MappedCachePath:
    """Copies from `kv` (the source's whole cache, [num_layers, 2, num_blocks, block_size,
    num_kv_heads, head_dim], mapped read-only), each copy confirmed by a ConfirmKVCopy call to
    `address` over `channel`, bounded by `timeout_s`. `owner_pid`: the process whose memory it
    is (same node); `name` the backend label."""

    name = ""

    def __init__(
        self,
        channel: grpc.Channel,
        address: str,
        kv: torch.Tensor,
        owner_pid: int,
        timeout_s: float,
        keep: object = None,
    ) -> None:
        """`keep`: what must live as long as the mapping (the segment)."""
        self.address, self.timeout_s = address, timeout_s
        self.kv, self.owner_pid, self._keep = kv, owner_pid, keep
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
        if self.kv.device.type == "cuda":  # the caller's device copies ran on its stream
            torch.cuda.synchronize()
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
                f"{self.name} copy of {handle.request_id!r} cancelled", "cancelled"
            ) from None
        if confirmed.num_blocks != len(block_ids):
            raise KVTransferError(
                f"{self.name} copy of {handle.request_id!r}: the source confirmed "
                f"{confirmed.num_blocks} of {len(block_ids)} blocks",
                "failed",
            )

    def _check_owner(self, handle: KVHandle) -> None:
        """KVTransferError ("unavailable": the caller forgets this source and handshakes again)
        when the process that owns the mapped cache is gone: its blocks are no one's now."""
        if not pid_alive(self.owner_pid):
            raise KVTransferError(
                f"{self.name} KV of {handle.request_id!r}: {self.address}'s cache belongs to "
                f"a process that is gone (pid {self.owner_pid})",
                "unavailable",
            )

    def close(self) -> None:
        """The mapping goes with the last view of it."""


class SharedMemoryPath(MappedCachePath):
    """The cache in the source's shared-memory segment (same host, CPU workers)."""

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
        shape = (spec.num_layers, 2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        kv = segment.tensor(shape, spec.dtype)
        super().__init__(channel, address, kv, segment.owner_pid, timeout_s, keep=segment)
