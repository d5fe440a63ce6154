"""The source's bookkeeping of one pull, shared by every data path it serves: the pull's handle
checked live (its lease renewed), a pin freed once a pull that held it ends, bytes counted, and
the test-only stall."""

from __future__ import annotations

import time
from collections.abc import Callable

from services.common import metrics
from services.common.convert import handle_from_proto
from services.common.pb import worker_pb2
from services.kv_transfer.handle import KVHandle
from services.kv_transfer.sender import KVSender


class PullGuard:
    """Pull bookkeeping at a source: `sender` holds the pins and leases, `on_engine(fn)` runs
    fn on the engine's thread without waiting (a freed pin goes back there), `block_bytes` is
    one block's K/V in bytes (for the byte counter), `stall_s` (test-only fault injection,
    `--debug-kv-stall-seconds`) holds every pull that long before its first block."""

    def __init__(
        self,
        sender: KVSender,
        on_engine: Callable[[Callable[[], object]], None],
        block_bytes: int,
        stall_s: float = 0.0,
    ) -> None:
        self.sender = sender
        self.on_engine = on_engine
        self.block_bytes = block_bytes
        self.stall_s = stall_s

    def check(self, pull: worker_pb2.PullKVRequest) -> KVHandle:
        """The pull's handle, once its transfer is known to be live (the lease renewed, as
        PullKV does). Raises RequestNotFoundError (how it ended), KVTransferError (closed)."""
        handle, _ = handle_from_proto(pull.handle)
        self.sender.source(handle)  # raises once closed / for an unknown engine
        if not self.sender.leases.renew(handle.request_id):
            self.sender.leases.begin_pull(handle.request_id)  # raises, saying how it ended
        return handle

    def end(self, request_id: str) -> None:
        """A pull of the request ended: free its pin now if it was released meanwhile."""
        if self.sender.leases.end_pull(request_id):
            self.on_engine(lambda: self.sender.release_pin(request_id))

    def count(self, backend: str, handle: KVHandle, first_block: int) -> None:
        """Count the bytes of the handle's blocks from `first_block` on as sent over `backend`."""
        nbytes = (len(handle.block_ids) - first_block) * self.block_bytes
        metrics.KV_TRANSFER_BYTES.labels("prefill", backend).inc(nbytes)

    def stall(self, context) -> None:
        """The test-only stall: wait `stall_s` seconds, or until the caller went away."""
        deadline = time.monotonic() + self.stall_s
        while time.monotonic() < deadline and context.is_active():
            time.sleep(0.05)
