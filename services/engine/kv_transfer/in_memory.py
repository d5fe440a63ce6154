"""In-process KV transfer: a PREFILL and a DECODE engine in one Python process (tests, demos)."""

from __future__ import annotations

import threading
import time

import torch

from services.engine.errors import RequestNotFoundError
from services.engine.kv_transfer.base import KVHandle, KVSource, KVTransfer, TransferStatus


# How long a release that arrived before its publish is remembered (seconds); longer than any
# prefill a cancelled client could still be waiting on.
EARLY_RELEASE_TTL_S = 600.0


class InMemoryKVTransfer(KVTransfer):
    """Pulls blocks by copying tensors straight out of the source engine's cache."""

    def __init__(self) -> None:
        self._sources: dict[str, KVSource] = {}
        self._status: dict[str, TransferStatus] = {}
        self._owner: dict[str, str] = {}  # request_id -> engine_id of the source that published it
        # request_id -> when a release came for a request not published yet (a client that
        # cancelled while its prefill ran): its publish unpins at once.
        self._released_early: dict[str, float] = {}
        self._lock = threading.Lock()
        self.bytes_transferred = 0

    def register_source(self, engine_id: str, source: KVSource) -> None:
        self._sources[engine_id] = source

    def is_local(self, handle: KVHandle) -> bool:
        """Whether the handle's source engine is registered with this transfer."""
        return handle.engine_id in self._sources

    def publish(self, handle: KVHandle) -> None:
        with self._lock:
            self._status[handle.request_id] = TransferStatus.PUBLISHED
            self._owner[handle.request_id] = handle.engine_id
            released_early = self._released_early.pop(handle.request_id, None) is not None
        if released_early:
            self.release(handle.request_id)

    def pull(self, handle: KVHandle, first_block: int = 0) -> torch.Tensor:
        with self._lock:
            source = self._sources.get(handle.engine_id)
            if self._status.get(handle.request_id) != TransferStatus.PUBLISHED or source is None:
                raise RequestNotFoundError(f"no published KV for request {handle.request_id!r}")
        data = source.read_kv(handle, first_block)
        self.bytes_transferred += data.numel() * data.element_size()
        return data

    def complete(self, handle: KVHandle) -> None:
        self.release(handle.request_id)

    def release(self, request_id: str) -> bool:
        """Mark a published transfer completed and unpin it at its source; False if not published
        (late or duplicate completions are harmless). A release for a request never published
        is remembered for `EARLY_RELEASE_TTL_S`, so its publish unpins at once."""
        with self._lock:
            status = self._status.get(request_id)
            if status is None:
                now = time.monotonic()
                self._released_early = {
                    rid: t for rid, t in self._released_early.items() if now - t < EARLY_RELEASE_TTL_S
                }
                self._released_early[request_id] = now
            if status != TransferStatus.PUBLISHED:
                return False
            self._status[request_id] = TransferStatus.COMPLETED
            source = self._sources[self._owner[request_id]]
        source.release_kv(request_id)
        return True

    def revoke(self, request_id: str) -> None:
        with self._lock:
            if self._status.get(request_id) == TransferStatus.PUBLISHED:
                self._status[request_id] = TransferStatus.RELEASED

    def status(self, request_id: str) -> TransferStatus | None:
        return self._status.get(request_id)
