"""In-process KV transfer: a PREFILL and a DECODE engine in one Python process (tests, demos)."""

from __future__ import annotations

import threading

import torch

from services.engine.errors import RequestNotFoundError
from services.engine.kv_transfer.base import KVHandle, KVSource, KVTransfer, TransferStatus


class InMemoryKVTransfer(KVTransfer):
    """Pulls blocks by copying tensors straight out of the source engine's cache."""

    def __init__(self) -> None:
        self._sources: dict[str, KVSource] = {}
        self._status: dict[str, TransferStatus] = {}
        self._lock = threading.Lock()
        self.bytes_transferred = 0

    def register_source(self, engine_id: str, source: KVSource) -> None:
        self._sources[engine_id] = source

    def publish(self, handle: KVHandle) -> None:
        with self._lock:
            self._status[handle.request_id] = TransferStatus.PUBLISHED

    def pull(self, handle: KVHandle) -> torch.Tensor:
        with self._lock:
            if self._status.get(handle.request_id) != TransferStatus.PUBLISHED:
                raise RequestNotFoundError(f"no published KV for request {handle.request_id!r}")
            source = self._sources[handle.engine_id]
        data = source.read_kv(handle)
        self.bytes_transferred += data.numel() * data.element_size()
        return data

    def complete(self, handle: KVHandle) -> None:
        with self._lock:
            if self._status.get(handle.request_id) != TransferStatus.PUBLISHED:
                return  # late or duplicate completion: harmless
            self._status[handle.request_id] = TransferStatus.COMPLETED
            source = self._sources[handle.engine_id]
        source.release_kv(handle.request_id)

    def revoke(self, request_id: str) -> None:
        with self._lock:
            if self._status.get(request_id) == TransferStatus.PUBLISHED:
                self._status[request_id] = TransferStatus.RELEASED

    def status(self, request_id: str) -> TransferStatus | None:
        return self._status.get(request_id)
