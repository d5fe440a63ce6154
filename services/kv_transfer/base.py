"""The KV-transfer interfaces: a sender side and a receiver side (SGLang's KVSender/KVReceiver,
vLLM's scheduler-side/worker-side connector split).

Pull model (as vLLM's NixlConnector): the PREFILL engine keeps a finished request's blocks pinned
under a lease (`lease.py`) and publishes a `KVHandle` through its `KVSender` (`sender.py`, the
transport-free source side every backend serves). The DECODE engine reserves blocks of its own,
handshakes with the source once (`handshake.py`), pulls the blocks it lacks through its
backend's `KVReceiver`, writes them into its cache, then calls `complete()` so the source
releases the pin exactly once. A destination that dies stops renewing the lease, and the source
frees the blocks when it lapses. Receivers: `in_memory.py` (both engines in one process) and
`services/kv_transfer/control/receiver.py` (across processes, over each data path of
`registry.py`); each runs the contract suite in tests/kv_transfer/test_contract.py.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Protocol

import torch

from services.kv_transfer.handle import KVHandle

if TYPE_CHECKING:
    from services.kv_transfer.handshake import KVPeerInfo


class KVSource(ABC):
    """The source side of a transfer: an engine that can read and release pinned blocks."""

    @property
    @abstractmethod
    def kv_peer_info(self) -> KVPeerInfo:
        """This engine's model and KV layout, for handshakes."""

    @abstractmethod
    def read_kv(
        self, handle: KVHandle, first_block: int = 0, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """K/V of the handle's blocks from `first_block` on:
        [num_layers, 2, len(block_ids) - first_block, block_size, num_kv_heads, head_dim]
        (written into `out`, contiguous and of that shape and dtype, when given).

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
    def pinned_blocks(self, handle: KVHandle, first_block: int = 0) -> tuple[int, ...]:
        """The handle's block ids from `first_block` on, once checked to be a pinned request's
        own (for a receiver that reads them in place, under a pull on the lease). Raises as
        `read_kv`."""

    @abstractmethod
    def release_kv(self, request_id: str) -> None:
        """Unpin the request's blocks; a second call for the same request does nothing."""


class KVReceiver(ABC):
    """The destination side of a transfer, one per backend: how a DECODE engine gets the
    prompt KV a KVHandle names from the `KVSender` that published it.

    A DECODE engine calls these on its own thread (`pull` there only when `is_ready`; a backend
    that streams, as gRPC does, lets the worker write the KV off the engine thread instead).
    """

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
        the source cannot be reached in time (reason "unavailable" for a dead one).
        """

    @abstractmethod
    def complete(self, handle: KVHandle) -> None:
        """Done with the handle (the KV landed, or the request ended before it did): the source
        may free its blocks. Idempotent; a late or duplicate call is harmless."""

    def close(self) -> None:  # noqa: B027 - most receivers hold nothing to close
        """Release what the receiver holds (threads, channels)."""


class DataPath(Protocol):
    """How one source's blocks reach a receiver across processes (one per backend, named in
    `services.kv_transfer.registry`): `stream` yields (block offset from `first_block`, piece)
    in order, each piece [num_layers, 2, n, block_size, num_kv_heads, head_dim]; `on_call(c)`
    gets the control call as it starts (`c.cancel()` cancels it)."""

    name: str

    def stream(
        self, handle: KVHandle, first_block: int, on_call: Callable[..., object] | None
    ) -> Iterator[tuple[int, torch.Tensor]]: ...

    def close(self) -> None: ...
