"""PREFILL role: finished requests whose prompt blocks stay pinned for a decode engine to pull.

When a PREFILL request has its first token, its prompt blocks are handed off here instead of
freed: they are pinned, a `KVHandle` naming them is published through the engine's `KVSender`
(which runs the lease), and this class serves reads of exactly those blocks until the sender
releases the pin (the transfer completed, the lease lapsed, or the request was aborted).
The DECODE side is `remote_kv.py` and `kv_reservations.py`.
"""

from __future__ import annotations

import torch

from services.engine.errors import InvalidRequestError, RequestNotFoundError
from services.engine.kv_cache import KVCache
from services.engine.request import Request
from services.kv_transfer.base import KVSource
from services.kv_transfer.handle import KVHandle
from services.kv_transfer.handshake import KVPeerInfo
from services.kv_transfer.sender import KVSender


class KVExport(KVSource):
    """The pinned requests of one PREFILL engine and the reads of their blocks (engine thread,
    except `kv_buffers`, which a KVTransfer stream calls under a pull on the lease)."""

    def __init__(
        self, engine_id: str, kv_cache: KVCache, sender: KVSender, peer_info: KVPeerInfo
    ) -> None:
        self.engine_id = engine_id
        self.kv_cache = kv_cache
        self.sender = sender
        self._peer_info = peer_info
        self.pinned: dict[str, Request] = {}  # finished, blocks held for export
        sender.register_source(engine_id, self)

    def hand_off(self, request: Request) -> KVHandle:
        """Pin a finished request's prompt blocks and publish a handle to them: every token's
        KV but the one just sampled (the prompt, plus a migrated request's earlier outputs)."""
        block_size = self.kv_cache.spec.block_size
        num_kv_tokens = request.num_tokens - 1
        handle = KVHandle(
            request.request_id,
            self.engine_id,
            tuple(request.block_table[: -(-num_kv_tokens // block_size)]),
            num_kv_tokens,
            request.output_token_ids[-1],
        )
        self.pinned[request.request_id] = request
        self.sender.publish(handle)
        return handle

    def abort(self, request_id: str) -> bool:
        """Revoke a pinned request's transfer and free its blocks (after a pull reading them,
        if one is in progress). False if it is not pinned here."""
        if request_id not in self.pinned:
            return False
        if self.sender.revoke(request_id):  # else freed when the pull reading it ends
            self.release_kv(request_id)
        return True

    @property
    def num_pinned_blocks(self) -> int:
        """Blocks held for export, awaiting a pull or their lease."""
        return sum(len(r.block_table) for r in self.pinned.values())

    # -- KVSource ------------------------------------------------------------------------------

    @property
    def kv_peer_info(self) -> KVPeerInfo:
        return self._peer_info

    def read_kv(
        self, handle: KVHandle, first_block: int = 0, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        self._pinned_request(handle, first_block)
        return self.kv_cache.read_blocks(list(handle.block_ids[first_block:]), out)

    def kv_buffers(self, handle: KVHandle, first_block: int, last_block: int) -> list[memoryview]:
        self._pinned_request(handle, first_block)
        if not first_block < last_block <= len(handle.block_ids):
            raise InvalidRequestError(
                "last_block", f"{last_block} outside the handle's blocks after {first_block}"
            )
        return self.kv_cache.block_buffers(list(handle.block_ids[first_block:last_block]))

    def pinned_blocks(self, handle: KVHandle, first_block: int = 0) -> tuple[int, ...]:
        self._pinned_request(handle, first_block)
        return handle.block_ids[first_block:]

    def release_kv(self, request_id: str) -> None:
        request = self.pinned.pop(request_id, None)
        if request is not None:
            self.kv_cache.free(request)

    def _pinned_request(self, handle: KVHandle, first_block: int) -> Request:
        request = self.pinned.get(handle.request_id)
        if (
            request is None
            or tuple(request.block_table[: len(handle.block_ids)]) != handle.block_ids
        ):
            raise RequestNotFoundError(handle.request_id)  # only a pinned request's own blocks
        if not 0 <= first_block < len(handle.block_ids):
            raise InvalidRequestError(
                "first_block", f"{first_block} outside the handle's {len(handle.block_ids)} blocks"
            )
        return request
