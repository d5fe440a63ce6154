"""The source side of every KV transfer: pinned prompt blocks under leases, served to receivers.

A PREFILL engine publishes each finished request's KVHandle here; the blocks stay pinned until a
destination completes the transfer, the lease lapses, or the source revokes it (`lease.py`).
Backends differ only in how a receiver reaches a sender: the in-memory receiver calls `read` in
the same process, and the gRPC backend's KVTransfer service streams `KVSource.kv_buffers` under
`begin_pull` / `end_pull` (services/kv_transfer/control/service.py). So this class is transport-free
and shared by every backend; one that needs more of the source (shared memory segments) extends
it, never a receiver.

Threads: `publish`, `expire_leases`, `release_pin` and `read` run on the source engine's thread;
`renew`, `status` and the lease transitions may run on any (the LeaseTable locks).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from services.engine.errors import KVTransferError, RequestNotFoundError
from services.engine.kv_cache import zeroed_kv
from services.kv_transfer.base import KVSource
from services.kv_transfer.handle import KVHandle
from services.kv_transfer.lease import DEFAULT_LEASE_S, LeaseTable, TransferStatus


class KVSender:
    """Pins and leases of the source engines registered here (usually one per process).

    `lease_s`: seconds a pinned request's blocks stay pinned without a renewal or a pull.
    """

    def __init__(
        self, lease_s: float = DEFAULT_LEASE_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.leases = LeaseTable(lease_s, clock)
        self._sources: dict[str, KVSource] = {}
        self._owner: dict[str, str] = {}  # request_id -> engine_id of the source that published it
        self._closed = False

    def allocate_kv(
        self, engine_id: str, shape: tuple[int, ...], dtype: torch.dtype, device: str
    ) -> torch.Tensor:
        """The zero-filled K/V tensor of source engine `engine_id`'s cache (`KVCache`'s
        allocator): plain memory here; a backend whose receivers read the cache in place
        (shared memory) puts it where they can map it."""
        return zeroed_kv(shape, dtype, device)

    def register_source(self, engine_id: str, source: KVSource) -> None:
        """Make `source`'s handles pullable under `engine_id`."""
        self._sources[engine_id] = source

    @property
    def engine_id(self) -> str:
        """The id of the one engine registered here ("" before; the handshake's answer)."""
        return next(iter(self._sources), "")

    def has_source(self, engine_id: str) -> bool:
        return not self._closed and engine_id in self._sources

    def source(self, handle: KVHandle) -> KVSource:
        """The engine that published `handle`. Raises KVTransferError (reason "unavailable")
        once this sender is closed, RequestNotFoundError for an engine not registered here."""
        if self._closed:
            raise KVTransferError("the KV source has shut down", reason="unavailable")
        source = self._sources.get(handle.engine_id)
        if source is None:
            raise RequestNotFoundError(f"no source engine {handle.engine_id!r} here")
        return source

    def publish(self, handle: KVHandle) -> None:
        """The handle's blocks are pinned and may be pulled; their lease starts now. A
        completion that arrived before the publish (the client cancelled while the prefill ran)
        releases the pin at once."""
        self._owner[handle.request_id] = handle.engine_id
        if not self.leases.publish(handle.request_id):
            self.release_pin(handle.request_id)

    def revoke(self, request_id: str) -> bool:
        """The source aborted the request: later pulls fail with RequestNotFoundError. True if
        the source may free the pin now; False while a pull reads the blocks (freed through
        `KVSource.release_kv` when that pull ends)."""
        if not self.leases.revoke(request_id):
            return False
        self._owner.pop(request_id, None)
        return True

    def renew(self, request_id: str) -> bool:
        """Extend the request's lease by the lease length from now; False if it already ended
        (the destination should give up on it)."""
        return self.leases.renew(request_id)

    def expire_leases(self) -> list[str]:
        """Release every pin whose lease lapsed with no pull in progress; returns their ids."""
        expired = self.leases.expire_due()
        for request_id in expired:
            self.release_pin(request_id)
        return expired

    def release(
        self, request_id: str, on_engine: Callable[[Callable[[], object]], object] | None = None
    ) -> bool:
        """A destination is done with the request's KV: unpin it. False if this call ended
        nothing (late, duplicate, or before the publish: then the publish unpins). The lease
        ends here, on any thread (the lease table has a lock); the pin is freed by
        `on_engine(fn)` on the source engine's thread (default: at once, the caller being on it;
        the gRPC service posts it to its engine loop)."""
        if not self.leases.complete(request_id):
            return False
        (on_engine or _run_now)(lambda: self.release_pin(request_id))
        return True

    def status(self, request_id: str) -> TransferStatus | None:
        """Current status of a request's transfer, or None if never published here."""
        return self.leases.status(request_id)

    def read(self, handle: KVHandle, first_block: int = 0) -> torch.Tensor:
        """A copy of a published handle's blocks from `first_block` on, taken under a pull (so
        its lease cannot lapse meanwhile). Raises RequestNotFoundError for an unknown or ended
        transfer, KVTransferError once closed."""
        source = self.source(handle)
        self.leases.begin_pull(handle.request_id)
        try:
            return source.read_kv(handle, first_block)
        finally:
            self.end_pull(handle.request_id)

    def end_pull(self, request_id: str) -> None:
        """A pull of the request ended; frees the pin if an end (completion, revocation) came
        during it. Source engine thread only."""
        if self.leases.end_pull(request_id):
            self.release_pin(request_id)

    def release_pin(self, request_id: str) -> None:
        """Free the request's pin at its source engine (source engine thread only)."""
        engine_id = self._owner.pop(request_id, None)
        if engine_id is not None:
            self._sources[engine_id].release_kv(request_id)

    def close(self) -> None:
        """Stop serving: later pulls fail as from a dead peer (reason "unavailable")."""
        self._closed = True


def _run_now(fn: Callable[[], object]) -> object:
    return fn()
