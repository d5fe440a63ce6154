"""KV transfer: how a PREFILL engine's blocks reach a DECODE engine."""

from services.engine.kv_transfer.base import KVHandle, KVSource, KVTransfer
from services.engine.kv_transfer.handshake import KVPeerInfo, check_compatible, mismatches
from services.engine.kv_transfer.in_memory import InMemoryKVTransfer
from services.engine.kv_transfer.lease import LeaseTable, TransferStatus

__all__ = [
    "InMemoryKVTransfer",
    "KVHandle",
    "KVPeerInfo",
    "KVSource",
    "KVTransfer",
    "LeaseTable",
    "TransferStatus",
    "check_compatible",
    "mismatches",
]
