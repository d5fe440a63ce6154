"""The KV-transfer interface shared by every backend (in-memory here; gRPC in services/common).

Pull model (as vLLM's NixlConnector): the PREFILL engine keeps a finished request's blocks pinned
under a lease (`lease.py`) and publishes a `KVHandle`. The DECODE engine reserves blocks of its
own, handshakes with the source once (`handshake.py`), pulls the blocks it lacks through the
handle, writes them into its cache, then calls `complete()` so the source releases the pin
exactly once. A destination that dies stops renewing the lease, and the source frees the blocks
when it lapses.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

from services.engine.kv_transfer.handle import KVHandle

if TYPE_CHECKING:
    from services.engine.kv_transfer.handshake import KVPeerInfo
    from services.engine.kv_transfer.lease import TransferStatus


class KVSource(ABC):
    """The source side of a transfer: an engine that can read and release pinned blocks."""

    @property
    @abstractmethod
    def kv_peer_info(self) -> KVPeerInfo:
        """This engine's model and KV layout, for handshakes."""

    @abstractmethod
    def read_kv(self, handle: KVHandle, first_block: int = 0) -> torch.Tensor:
        """K/V of the handle's blocks from `first_block` on:
        [num_layers, 2, len(block_ids) - first_block, block_size, num_kv_heads, head_dim].

        Raises RequestNotFoundError if the handle was already released, InvalidRequestError for a
        `first_block` outside the handle.
        """

    @abstractmethod
    def kv_buffers(self, handle: KVHandle, first_block: int, last_block: int) -> list[memoryview]:
        """The handle's blocks [first_block, last_block) as C-order bytes in the layout of
        `read_kv`, without a copy: buffers to be concatenated in order. They are views of the
        live cache, valid only while the caller holds a pull on the request's lease (which
        keeps the blocks from being freed). Raises as `read_kv`."""

    @abstractmethod
    def release_kv(self, request_id: str) -> None:
        """Unpin the request's blocks; a second call for the same request does nothing."""


class KVTransfer(ABC):
    """Moves pinned prompt blocks from a source engine to a destination engine.

    Source-side methods run on the source engine's thread; `renew` and `status` may run on any.
    """

    # -- source side ---------------------------------------------------------------------------

    @abstractmethod
    def register_source(self, engine_id: str, source: KVSource) -> None:
        """Make `source`'s handles pullable under `engine_id`."""

    @abstractmethod
    def publish(self, handle: KVHandle) -> None:
        """The handle's blocks are pinned and may be pulled; their lease starts now. A
        completion that arrived before the publish (the client cancelled while the prefill ran)
        releases the pin at once."""

    @abstractmethod
    def revoke(self, request_id: str) -> bool:
        """The source aborted the request: later pulls fail with RequestNotFoundError. True if
        the source may free the pin now; False while a pull reads the blocks (the transfer then
        frees them through `KVSource.release_kv` when that pull ends)."""

    @abstractmethod
    def renew(self, request_id: str) -> bool:
        """Extend the request's lease by the lease length from now; False if it already ended
        (the destination should give up on it)."""

    @abstractmethod
    def expire_leases(self) -> list[str]:
        """Release every pin whose lease lapsed with no pull in progress; returns their ids."""

    @abstractmethod
    def status(self, request_id: str) -> TransferStatus | None:
        """Current status of a request's transfer, or None if never published here."""

    # -- destination side ----------------------------------------------------------------------

    @abstractmethod
    def connect(self, handle: KVHandle, local: KVPeerInfo) -> None:
        """Handshake with the handle's source (once per source): raises KVHandshakeError naming
        each field where its model or KV layout differs from `local`, KVTransferError when it
        cannot be reached."""

    @abstractmethod
    def is_ready(self, handle: KVHandle) -> bool:
        """Whether `pull` can return the handle's blocks now without waiting on a network (the
        source is in this process). A DECODE engine admits a request whose transfer is not
        ready only once a caller wrote its KV (`Engine.take_reserved(claim_writes=True)`)."""

    @abstractmethod
    def pull(self, handle: KVHandle, first_block: int = 0) -> list[torch.Tensor]:
        """Fetch the handle's blocks from `first_block` on (the ones before it are in the
        destination's own prefix cache): tensors of shape [num_layers, 2, n_i, block_size,
        num_kv_heads, head_dim] that cover those blocks in order (possibly read-only views of
        received messages: copy, never write).

        Raises RequestNotFoundError for an unknown or released handle, KVTransferError when
        the source cannot be reached in time.
        """

    @abstractmethod
    def complete(self, handle: KVHandle) -> None:
        """Done with the handle (the KV landed, or the request ended before it did): the source
        may free its blocks. Idempotent; a late or duplicate call is harmless."""
