"""KV transfer on one node, source side: the KVTransfer RPCs through which a prefill worker
serves its blocks without putting them in gRPC messages (mixed into `KVTransferServicer`).

- ConfirmKVCopy (same host): the receiver copies the blocks out of the cache's shared-memory
  segment (`services/kv_transfer/shared_memory/source.py`; CPU) or out of its GPU memory
  through CUDA IPC (`cuda_ipc.py`; same GPU or peer GPUs) with no call before,
  then asks whether the transfer is still live, which makes its copy good (optimistic reads
  validated after, as a seqlock reader does; one round trip per pull).
- OpenKVGroup / SendKV (torch.distributed): one process group per decode worker, opened by it
  and held as long as its OpenKVGroup call lasts (`kv_backends/dist_group.py`); SendKV sends a
  request's blocks through it under a pull, one send at a time per group.

Both keep the lease rules of PullKV: a receiver that dies or hangs stops renewing, and the
lease frees the pin (a copy confirmed after that is refused).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from services.common import metrics
from services.common.convert import handle_from_proto
from services.common.errors import ServiceUnavailableError
from services.common.pb import worker_pb2
from services.engine.errors import KVHandshakeError, RequestNotFoundError
from services.kv_transfer.handle import KVHandle
from services.kv_transfer.sender import KVSender
from services.kv_transfer.torch_dist.group import PairGroup, StagingBuffer, group_name, serve_store

logger = logging.getLogger(__name__)


class _Group:
    """A pair's group at the source, with the lock that keeps one send in flight."""

    def __init__(self, group: PairGroup, peer: str) -> None:
        self.group, self.peer = group, peer
        self.lock = threading.Lock()
        self.staging = StagingBuffer()  # what SendKV gathers the blocks into
        self.closed = threading.Event()  # asked to close
        self.finished = threading.Event()  # torn down


class LocalKVPaths:
    """The one-node RPCs of the KVTransfer service. Expects of its host class: `sender`,
    `on_engine`, `block_bytes`, `dist_device` (the cache's device when torch.distributed is
    served, else None), `dist_host`, `group_timeout_s` and `_stall(context)`."""

    sender: KVSender
    on_engine: Callable[[Callable[[], object]], None]
    block_bytes: int
    dist_device: str | None
    dist_host: str
    group_timeout_s: float
    _groups: dict[str, _Group]
    _pending_groups: dict[str, threading.Event]

    def _stall(self, context) -> None: ...

    def _check(self, pull: worker_pb2.PullKVRequest) -> KVHandle:
        """The pull's handle, once its transfer is known to be live (the lease renewed, as
        PullKV does). Raises RequestNotFoundError (how it ended), KVTransferError (closed)."""
        handle, _ = handle_from_proto(pull.handle)
        self.sender.source(handle)  # raises once closed / for an unknown engine
        if not self.sender.leases.renew(handle.request_id):
            self.sender.leases.begin_pull(handle.request_id)  # raises, saying how it ended
        return handle

    def _end(self, request_id: str) -> None:
        if self.sender.leases.end_pull(request_id):  # released while we held it: free it now
            self.on_engine(lambda: self.sender.release_pin(request_id))

    def _count(self, backend: str, handle: KVHandle, first_block: int) -> None:
        nbytes = (len(handle.block_ids) - first_block) * self.block_bytes
        metrics.KV_TRANSFER_BYTES.labels("prefill", backend).inc(nbytes)

    # -- shared memory -------------------------------------------------------------------------

    def ConfirmKVCopy(self, request, context) -> worker_pb2.ConfirmKVCopyResponse:
        """The receiver copied the handle's blocks out of the segment with no call before:
        they were pinned at publish and a pin ends only with its transfer, so the copy is good
        if the transfer is still live now, and the handle names the pinned request's own
        blocks. Raises RequestNotFoundError (NOT_FOUND) otherwise."""
        self._stall(context)
        handle = self._check(request)
        num_blocks = len(self.sender.source(handle).pinned_blocks(handle, request.first_block))
        # A source maps one kind of cache: its shared-memory segment (CPU) or its GPU memory.
        mapped = "cuda_ipc" if getattr(self, "cuda_kv", None) is not None else "shared_memory"
        self._count(mapped, handle, request.first_block)
        return worker_pb2.ConfirmKVCopyResponse(num_blocks=num_blocks)

    # -- torch.distributed ---------------------------------------------------------------------

    def OpenKVGroup(self, request, context) -> Iterator[worker_pb2.KVGroupInfo]:
        if self.dist_device is None:
            raise KVHandshakeError(
                "this prefill worker serves no torch.distributed KV transfer "
                "(its --kv-transfer-backend)"
            )
        store = serve_store(self.dist_host, self.group_timeout_s)
        name = group_name()
        built: dict[str, Any] = {}  # "group": the PairGroup, or "error": why it failed

        def build() -> None:  # rendezvous with the caller, who builds rank 1 meanwhile
            try:
                device_type = torch.device(self.dist_device or "cpu").type
                built["group"] = PairGroup(
                    store, name, 0, device_type, self.group_timeout_s, self.dist_host
                )
            except RuntimeError as exc:
                built["error"] = exc

        thread = threading.Thread(target=build, name="kv-group-setup", daemon=True)
        ready = self._pending_groups[name] = threading.Event()  # SendKV may come first
        thread.start()
        yield worker_pb2.KVGroupInfo(
            store_host=self.dist_host,
            store_port=store.port,
            group=name,
            backend="nccl" if torch.device(self.dist_device).type == "cuda" else "gloo",
        )
        thread.join(self.group_timeout_s + 5)
        if "group" not in built:
            self._pending_groups.pop(name, None)
            ready.set()
            logger.warning("KV group with %s failed: %s", request.engine_id, built.get("error"))
            return
        entry = _Group(built["group"], request.engine_id)
        self._groups[name] = entry
        self._pending_groups.pop(name, None)
        ready.set()
        logger.info("KV group %s with %s (%s) open", name, request.engine_id, entry.group.backend)
        context.add_callback(entry.closed.set)
        try:
            while context.is_active() and not entry.closed.wait(1.0):
                pass
        finally:
            self._groups.pop(name, None)
            with entry.lock:
                entry.group.close()
            entry.finished.set()
            logger.info("KV group %s with %s closed", name, request.engine_id)

    def SendKV(self, request, context) -> Iterator[worker_pb2.SendKVStatus]:
        entry = self._groups.get(request.group)
        pending = self._pending_groups.get(request.group)
        if entry is None and pending is not None:
            # The caller's half of the rendezvous can finish, and its SendKV arrive, before
            # this side's OpenKVGroup has registered the group: wait for it, bounded.
            pending.wait(self.group_timeout_s)
            entry = self._groups.get(request.group)
        if entry is None:
            raise RequestNotFoundError(f"no KV group {request.group!r} here (it was closed)")
        handle = self._check(request.pull)
        first_block, rid = request.pull.first_block, handle.request_id
        self._stall(context)
        source = self.sender.source(handle)
        spec = source.kv_peer_info.spec
        n = len(handle.block_ids) - first_block
        shape = (spec.num_layers, 2, n, spec.block_size, spec.num_kv_heads, spec.head_dim)
        with entry.lock:  # one send at a time per pair, from its staging buffer
            self.sender.leases.begin_pull(rid)  # held for the read only: the send is of a copy
            try:
                data = source.read_kv(
                    handle,
                    first_block,
                    entry.staging.view(shape, spec.dtype, self.dist_device or "cpu"),
                )
            finally:
                self._end(rid)
            yield worker_pb2.SendKVStatus(sent=False)
            try:
                entry.group.send(data, request.tag)
            except RuntimeError as exc:
                entry.closed.set()  # a failed group is unusable: the receiver opens another
                raise ServiceUnavailableError(
                    f"sending KV of {rid!r} to {entry.peer}: {exc}"
                ) from None
        self._count("torch_dist", handle, first_block)
        yield worker_pb2.SendKVStatus(sent=True)

    def close_groups(self, timeout_s: float = 5.0) -> None:
        """End every group's OpenKVGroup call and wait (up to `timeout_s`) until each is torn
        down: the worker is stopping, and a process group still alive at interpreter exit
        aborts the process."""
        entries = list(self._groups.values())
        for entry in entries:
            entry.closed.set()
        for entry in entries:
            entry.finished.wait(timeout_s)
