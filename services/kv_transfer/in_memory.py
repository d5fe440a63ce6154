"""In-process KV transfer: a PREFILL and a DECODE engine in one Python process (tests, demos).

`InMemoryKVReceiver` pulls by copying tensors straight out of a `KVSender` in the same process;
`InMemoryKVTransfer` is the pair both engines are built with.
"""

from __future__ import annotations

import torch

from services.engine.errors import KVTransferError
from services.kv_transfer.base import KVReceiver
from services.kv_transfer.handle import KVHandle
from services.kv_transfer.handshake import KVPeerInfo, check_compatible
from services.kv_transfer.lease import DEFAULT_LEASE_S
from services.kv_transfer.sender import KVSender


class InMemoryKVReceiver(KVReceiver):
    """Reads the published blocks of `sender`'s engines; `bytes_transferred` counts them."""

    def __init__(self, sender: KVSender) -> None:
        self.sender = sender
        self.bytes_transferred = 0

    def connect(self, handle: KVHandle, local: KVPeerInfo) -> None:
        if not self.sender.has_source(handle.engine_id):
            raise KVTransferError(f"no KV source {handle.engine_id!r} here", reason="unavailable")
        source = self.sender.source(handle)
        check_compatible(source.kv_peer_info, local, f"engine {handle.engine_id}")

    def is_ready(self, handle: KVHandle) -> bool:
        return self.sender.has_source(handle.engine_id)

    def pull(self, handle: KVHandle, first_block: int = 0) -> list[torch.Tensor]:
        data = self.sender.read(handle, first_block)
        self.bytes_transferred += data.numel() * data.element_size()
        return [data]

    def complete(self, handle: KVHandle) -> None:
        self.sender.release(handle.request_id)


class InMemoryKVTransfer:
    """Both sides in one process: `sender` for the PREFILL engine, `receiver` for the DECODE
    engine (`Engine(config, transfer.sender, transfer.receiver)` for either role)."""

    def __init__(self, lease_s: float = DEFAULT_LEASE_S) -> None:
        self.sender = KVSender(lease_s)
        self.receiver = InMemoryKVReceiver(self.sender)
