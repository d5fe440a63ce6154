"""The torch.distributed data path: the decode worker opens a two-rank process group with each
source on first use (OpenKVGroup, held open for the group's life:
`kv_transfer/torch_dist/group.py`), and each pull is a SendKV call that tells the source to send
the blocks as one tensor while this side receives it (NCCL between GPUs, gloo between CPU
processes). One pull at a time per pair, so the sends and receives of a pair pair up in order; a
failed or timed-out operation drops the group,
and the next pull opens a new one."""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import threading
from collections.abc import Callable, Iterator

import grpc
import torch

from services.common.convert import handle_to_proto
from services.common.pb import worker_pb2, worker_pb2_grpc
from services.engine.errors import KVTransferError
from services.engine.kv_cache import KVCacheSpec
from services.kv_transfer.handle import KVHandle
from services.kv_transfer.torch_dist.group import PairGroup, StagingBuffer, join_store

logger = logging.getLogger(__name__)


class TorchDistPath:
    """Receives from the source at `address` through a group on `device` (the local cache's),
    every call and collective bounded by `timeout_s`; `engine_id`: this side's, for its log."""

    name = "torch_dist"

    def __init__(
        self,
        channel: grpc.Channel,
        address: str,
        spec: KVCacheSpec,
        device: str,
        timeout_s: float,
        engine_id: str = "",
    ) -> None:
        self.address, self.spec, self.device = address, spec, device
        self.timeout_s, self.engine_id = timeout_s, engine_id
        self._stub = worker_pb2_grpc.KVTransferStub(channel)
        self._lock = threading.Lock()  # one pull in flight per pair
        self._group: PairGroup | None = None
        self._group_call: grpc.Call | None = None
        self._tags = itertools.count()
        self._staging = StagingBuffer()  # what each pull receives into

    def open(self) -> None:
        """Set up the group now, if there is none. Raises KVTransferError (reason
        "unavailable") when the source or the rendezvous fails in time."""
        with self._lock:
            self._open()

    def _open(self) -> PairGroup:
        if self._group is not None:
            return self._group
        call = self._stub.OpenKVGroup(worker_pb2.KVGroupRequest(engine_id=self.engine_id))
        with concurrent.futures.ThreadPoolExecutor(1) as first:
            try:
                info = first.submit(next, call).result(self.timeout_s)
                store = join_store(info.store_host, info.store_port, self.timeout_s)
                group = PairGroup(
                    store, info.group, 1, torch.device(self.device).type, self.timeout_s
                )
            except (grpc.RpcError, StopIteration, RuntimeError, TimeoutError) as exc:
                call.cancel()
                raise KVTransferError(
                    f"opening a torch.distributed KV group with {self.address}: {exc}",
                    "unavailable",
                ) from None
        self._group, self._group_call = group, call
        threading.Thread(target=self._watch, args=(call, group), daemon=True).start()
        logger.info("KV group %s with %s (%s) open", info.group, self.address, group.backend)
        return group

    def _watch(self, call: grpc.Call, group: PairGroup) -> None:
        """The source ends OpenKVGroup when it drops the group (it failed, or the worker is
        stopping): drop it here too."""
        try:
            for _ in call:  # type: ignore[attr-defined]
                pass
        except grpc.RpcError:
            pass
        with self._lock:
            self._drop(group)

    def _drop(self, group: PairGroup | None = None) -> None:
        if self._group is None or (group is not None and group is not self._group):
            return
        self._group.close()
        if self._group_call is not None:
            self._group_call.cancel()
        self._group = self._group_call = None

    def stream(
        self,
        handle: KVHandle,
        first_block: int,
        on_call: Callable[[object], object] | None,
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """One piece: (0, the blocks from `first_block` on, received into the pair's staging
        buffer; valid until the caller asks for more, which it must do before another pull of
        this pair can start).
        `on_call` gets an object whose cancel() ends the call until the send began (after
        that the pull completes: a recv cannot be taken back). Raises grpc.RpcError,
        KVTransferError."""
        n = len(handle.block_ids) - first_block
        spec = self.spec
        shape = (spec.num_layers, 2, n, spec.block_size, spec.num_kv_heads, spec.head_dim)
        with self._lock:
            group = self._open()
            tag = next(self._tags)
            request = worker_pb2.SendKVRequest(
                pull=worker_pb2.PullKVRequest(
                    handle=handle_to_proto(handle, self.address), first_block=first_block
                ),
                group=group.name,
                tag=tag,
            )
            call = self._stub.SendKV(request, timeout=self.timeout_s)
            cancel = _CancelUntilSent(call)
            if on_call is not None:
                on_call(cancel)
            next(call)  # the source read the blocks: it sends now
            cancel.sending = True
            buffer = self._staging.view(shape, spec.dtype, self.device)
            try:
                group.recv(buffer, tag)
            except RuntimeError as exc:
                self._drop(group)
                raise KVTransferError(
                    f"receiving KV of {handle.request_id!r} from {self.address}: {exc}",
                    "unavailable",
                ) from None
            sent = next(call, None)
            if sent is None or not sent.sent:
                raise KVTransferError(f"KV send of {handle.request_id!r} did not complete")
            yield 0, buffer  # under the lock: the next pull reuses the buffer

    def close(self) -> None:
        with self._lock:
            self._drop()


class _CancelUntilSent:
    """What a cancelled Decode call may cancel: the SendKV call, until the send began."""

    def __init__(self, call: grpc.Call) -> None:
        self.call, self.sending = call, False

    def cancel(self) -> bool:
        return False if self.sending else self.call.cancel()
