"""The torch.distributed data path, source side: the OpenKVGroup / SendKV RPCs of the prefill
worker's KVTransfer service. One process group per decode worker, opened by it and held as long
as its OpenKVGroup call lasts (`group.py`); SendKV sends a request's blocks through it under a
pull, one send at a time per group. A receiver that dies or hangs stops renewing its leases, and
the lease frees the pin."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

import torch

from services.common.errors import ServiceUnavailableError
from services.common.pb import worker_pb2
from services.engine.errors import KVHandshakeError, RequestNotFoundError
from services.kv_transfer.control.pulls import PullGuard
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


class GroupServer:
    """The source's process groups, one per decode worker. `pulls`: the source's pull
    bookkeeping; `dist_device`: where the cache lives (None: torch.distributed is not served);
    groups build their stores on `dist_host`, every group operation bounded by
    `group_timeout_s`."""

    def __init__(
        self, pulls: PullGuard, dist_device: str | None, dist_host: str, group_timeout_s: float
    ) -> None:
        self.pulls = pulls
        self.dist_device = dist_device
        self.dist_host = dist_host
        self.group_timeout_s = group_timeout_s
        self.groups: dict[str, _Group] = {}  # group name -> the open group
        self.pending: dict[str, threading.Event] = {}  # opened, still forming

    def __len__(self) -> int:
        """Open groups."""
        return len(self.groups)

    def open(self, request, context) -> Iterator[worker_pb2.KVGroupInfo]:
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
        ready = self.pending[name] = threading.Event()  # SendKV may come first
        thread.start()
        yield worker_pb2.KVGroupInfo(
            store_host=self.dist_host,
            store_port=store.port,
            group=name,
            backend="nccl" if torch.device(self.dist_device).type == "cuda" else "gloo",
        )
        thread.join(self.group_timeout_s + 5)
        if "group" not in built:
            self.pending.pop(name, None)
            ready.set()
            logger.warning("KV group with %s failed: %s", request.engine_id, built.get("error"))
            return
        entry = _Group(built["group"], request.engine_id)
        self.groups[name] = entry
        self.pending.pop(name, None)
        ready.set()
        logger.info("KV group %s with %s (%s) open", name, request.engine_id, entry.group.backend)
        context.add_callback(entry.closed.set)
        try:
            while context.is_active() and not entry.closed.wait(1.0):
                pass
        finally:
            self.groups.pop(name, None)
            with entry.lock:
                entry.group.close()
            entry.finished.set()
            logger.info("KV group %s with %s closed", name, request.engine_id)

    def send(self, request, context) -> Iterator[worker_pb2.SendKVStatus]:
        entry = self.groups.get(request.group)
        pending = self.pending.get(request.group)
        if entry is None and pending is not None:
            # The caller's half of the rendezvous can finish, and its SendKV arrive, before
            # this side's OpenKVGroup has registered the group: wait for it, bounded.
            pending.wait(self.group_timeout_s)
            entry = self.groups.get(request.group)
        if entry is None:
            raise RequestNotFoundError(f"no KV group {request.group!r} here (it was closed)")
        handle = self.pulls.check(request.pull)
        first_block, rid = request.pull.first_block, handle.request_id
        self.pulls.stall(context)
        source = self.pulls.sender.source(handle)
        spec = source.kv_peer_info.spec
        n = len(handle.block_ids) - first_block
        shape = (spec.num_layers, 2, n, spec.block_size, spec.num_kv_heads, spec.head_dim)
        with entry.lock:  # one send at a time per pair, from its staging buffer
            self.pulls.sender.leases.begin_pull(
                rid
            )  # held for the read only: the send is of a copy
            try:
                data = source.read_kv(
                    handle,
                    first_block,
                    entry.staging.view(shape, spec.dtype, self.dist_device or "cpu"),
                )
            finally:
                self.pulls.end(rid)
            yield worker_pb2.SendKVStatus(sent=False)
            try:
                entry.group.send(data, request.tag)
            except RuntimeError as exc:
                entry.closed.set()  # a failed group is unusable: the receiver opens another
                raise ServiceUnavailableError(
                    f"sending KV of {rid!r} to {entry.peer}: {exc}"
                ) from None
        self.pulls.count("torch_dist", handle, first_block)
        yield worker_pb2.SendKVStatus(sent=True)

    def close(self, timeout_s: float = 5.0) -> None:
        """End every group's OpenKVGroup call and wait (up to `timeout_s`) until each is torn
        down: the worker is stopping, and a process group still alive at interpreter exit
        aborts the process."""
        entries = list(self.groups.values())
        for entry in entries:
            entry.closed.set()
        for entry in entries:
            entry.finished.wait(timeout_s)
