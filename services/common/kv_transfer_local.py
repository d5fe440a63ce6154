"""KV transfer on one node, source side: the KVTransfer RPCs through which a prefill worker
serves its blocks without putting them in gRPC messages (mixed into `KVTransferServicer`).

- PullKVShared (same host, CPU): the receiver copies the blocks out of the cache's shared-memory
  segment (`services/engine/kv_transfer/shared_memory.py`) while this call holds a pull on the
  request's lease; the call answers the pinned block ids, then waits for `copied`.
- OpenKVGroup / SendKV (torch.distributed): one process group per decode worker, opened by it
  and held as long as its OpenKVGroup call lasts (`kv_backends/dist_group.py`); SendKV sends a
  request's blocks through it under a pull, one send at a time per group.

Both keep the lease rules of PullKV: a pull holds the blocks only while its call lives (a
receiver that dies ends the call, the pull, and then the lease frees the pin).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from services.common import metrics
from services.common.convert import handle_from_proto
from services.common.errors import ServiceUnavailableError
from services.common.kv_backends.dist_group import PairGroup, group_name, serve_store
from services.common.pb import worker_pb2
from services.engine.errors import KVHandshakeError, RequestNotFoundError
from services.engine.kv_transfer.handle import KVHandle
from services.engine.kv_transfer.sender import KVSender

logger = logging.getLogger(__name__)


class _Group:
    """A pair's group at the source, with the lock that keeps one send in flight."""

    def __init__(self, group: PairGroup, peer: str) -> None:
        self.group, self.peer = group, peer
        self.lock = threading.Lock()
        self.closed = threading.Event()


class LocalKVPaths:
    """The one-node RPCs of the KVTransfer service. Expects of its host class: `sender`,
    `on_engine`, `block_bytes`, `dist_device` (the cache's device type when torch.distributed is
    served, else None), `dist_host`, `group_timeout_s` and `_stall(context)`."""

    sender: KVSender
    on_engine: Callable[[Callable[[], object]], None]
    block_bytes: int
    dist_device: str | None
    dist_host: str
    group_timeout_s: float
    _groups: dict[str, _Group]

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

    def PullKVShared(self, request_iterator, context):
        """The lease is held by a pull from the grant until `copied`, at most one lease length:
        a receiver that hangs mid-copy cannot hold the blocks longer than one (its copy is then
        refused, done = false, and the lease runs out as usual)."""
        first = next(request_iterator, None)
        if first is None:
            return
        handle = self._check(first.pull)
        first_block, rid = first.pull.first_block, handle.request_id
        block_ids = self.sender.source(handle).pinned_blocks(handle, first_block)
        self._stall(context)
        replies: queue.SimpleQueue = queue.SimpleQueue()
        self.sender.leases.begin_pull(rid)
        try:
            threading.Thread(
                target=_next_message, args=(request_iterator, replies), daemon=True
            ).start()
            yield worker_pb2.KVSharedGrant(block_ids=block_ids)
            try:
                message = replies.get(timeout=self.sender.leases.lease_s)
            except queue.Empty:
                message = None
        finally:
            self._end(rid)
        if message is not None and message.copied:
            self._count("shared_memory", handle, first_block)
            yield worker_pb2.KVSharedGrant(done=True)
        else:
            yield worker_pb2.KVSharedGrant(done=False)

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
                built["group"] = PairGroup(
                    store, name, 0, self.dist_device or "cpu", self.group_timeout_s, self.dist_host
                )
            except RuntimeError as exc:
                built["error"] = exc

        thread = threading.Thread(target=build, name="kv-group-setup", daemon=True)
        thread.start()
        yield worker_pb2.KVGroupInfo(
            store_host=self.dist_host,
            store_port=store.port,
            group=name,
            backend="nccl" if self.dist_device == "cuda" else "gloo",
        )
        thread.join(self.group_timeout_s + 5)
        if "group" not in built:
            logger.warning("KV group with %s failed: %s", request.engine_id, built.get("error"))
            return
        entry = _Group(built["group"], request.engine_id)
        self._groups[name] = entry
        logger.info("KV group %s with %s (%s) open", name, request.engine_id, entry.group.backend)
        context.add_callback(entry.closed.set)
        try:
            while context.is_active() and not entry.closed.wait(1.0):
                pass
        finally:
            self._groups.pop(name, None)
            with entry.lock:
                entry.group.close()
            logger.info("KV group %s with %s closed", name, request.engine_id)

    def SendKV(self, request, context) -> Iterator[worker_pb2.SendKVStatus]:
        entry = self._groups.get(request.group)
        if entry is None:
            raise RequestNotFoundError(f"no KV group {request.group!r} here (it was closed)")
        handle = self._check(request.pull)
        first_block, rid = request.pull.first_block, handle.request_id
        self._stall(context)
        self.sender.leases.begin_pull(rid)  # held for the read only: the send is of a copy
        try:
            data = self.sender.source(handle).read_kv(handle, first_block).contiguous()
        finally:
            self._end(rid)
        yield worker_pb2.SendKVStatus(sent=False)
        with entry.lock:
            try:
                entry.group.send(data, request.tag)
            except RuntimeError as exc:
                entry.closed.set()  # a failed group is unusable: the receiver opens another
                raise ServiceUnavailableError(
                    f"sending KV of {rid!r} to {entry.peer}: {exc}"
                ) from None
        self._count("torch_dist", handle, first_block)
        yield worker_pb2.SendKVStatus(sent=True)

    def close_groups(self) -> None:
        """End every group's OpenKVGroup call (the worker is stopping)."""
        for entry in list(self._groups.values()):
            entry.closed.set()


def _next_message(messages: Iterator, into: queue.SimpleQueue) -> None:
    """Put the call's next message into `into`, or None once the call ended (or broke)."""
    try:
        into.put(next(messages, None))
    except grpc.RpcError:
        into.put(None)
