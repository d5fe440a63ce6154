"""KV transfer: how a PREFILL engine's blocks reach a DECODE engine."""

from services.engine.kv_transfer.base import KVHandle, KVSource, KVTransfer, TransferStatus
from services.engine.kv_transfer.in_memory import InMemoryKVTransfer

__all__ = ["InMemoryKVTransfer", "KVHandle", "KVSource", "KVTransfer", "TransferStatus"]
