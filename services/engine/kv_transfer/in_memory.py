"""In-process KV transfer: a PREFILL and a DECODE engine in one Python process (tests, demos)."""

from __future__ import annotations

import torch

from services.engine.errors import RequestNotFoundError
from services.engine.kv_transfer.base import KVHandle, KVSource, KVTransfer
from services.engine.kv_transfer.handshake import KVPeerInfo, check_compatible
from services.engine.kv_transfer.lease import DEFAULT_LEASE_S, LeaseTable, TransferStatus


class InMemoryKVTransfer(KVTransfer):
    """Pulls blocks by copying tensors straight out of the source engine's cache.

    `lease_s`: seconds a pinned request's blocks stay pinned without a renewal or a pull.
    """

    def __init__(self, lease_s: float = DEFAULT_LEASE_S) -> None:
        self._sources: dict[str, KVSource] = {}
        self.leases = LeaseTable(lease_s)
        self._owner: dict[str, str] = {}  # request_id -> engine_id of the source that published it
        self.bytes_transferred = 0

    # -- source side ---------------------------------------------------------------------------

    def register_source(self, engine_id: str, source: KVSource) -> None:
        self._sources[engine_id] = source

    def is_local(self, handle: KVHandle) -> bool:
        """Whether the handle's source engine is registered with this transfer."""
        return handle.engine_id in self._sources

    def publish(self, handle: KVHandle) -> None:
        self._owner[handle.request_id] = handle.engine_id
        if not self.leases.publish(handle.request_id):
            self.release_pin(handle.request_id)

    def revoke(self, request_id: str) -> bool:
        if not self.leases.revoke(request_id):
            return False
        self._owner.pop(request_id, None)
        return True

    def renew(self, request_id: str) -> bool:
        return self.leases.renew(request_id)

    def expire_leases(self) -> list[str]:
        expired = self.leases.expire_due()
        for request_id in expired:
            self.release_pin(request_id)
        return expired

    def release(self, request_id: str) -> bool:
        """A destination is done with the request's KV: unpin it at its source. False if this
        call ended nothing (late, duplicate, or before the publish: then the publish unpins)."""
        if not self.leases.complete(request_id):
            return False
        self.release_pin(request_id)
        return True

    def status(self, request_id: str) -> TransferStatus | None:
        return self.leases.status(request_id)

    def source(self, handle: KVHandle) -> KVSource:
        """The engine in this process that published `handle`; RequestNotFoundError if none."""
        source = self._sources.get(handle.engine_id)
        if source is None:
            raise RequestNotFoundError(f"no source engine {handle.engine_id!r} in this process")
        return source

    def read(self, handle: KVHandle, first_block: int = 0) -> torch.Tensor:
        """A copy of a published handle's blocks, taken under a pull (so its lease cannot lapse
        meanwhile). Raises RequestNotFoundError for an unknown or ended transfer."""
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

    # -- destination side ----------------------------------------------------------------------

    def connect(self, handle: KVHandle, local: KVPeerInfo) -> None:
        source = self._sources.get(handle.engine_id)
        if source is not None:
            check_compatible(source.kv_peer_info, local, f"engine {handle.engine_id}")

    def is_ready(self, handle: KVHandle) -> bool:
        return self.is_local(handle)

    def pull(self, handle: KVHandle, first_block: int = 0) -> list[torch.Tensor]:
        data = self.read(handle, first_block)
        self.bytes_transferred += data.numel() * data.element_size()
        return [data]

    def complete(self, handle: KVHandle) -> None:
        self.release(handle.request_id)
