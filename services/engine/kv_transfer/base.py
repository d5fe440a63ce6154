"""The KV-transfer interface shared by every backend (in-memory here; gRPC in services/common).

Pull model (as vLLM's NixlConnector): the PREFILL engine keeps a finished request's blocks pinned
and publishes a `KVHandle`; the DECODE engine pulls the blocks it lacks through the handle, writes
them into its own cache, then calls `complete()` so the source releases the pin exactly once.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


class TransferStatus(enum.Enum):
    """Lifecycle of one request's transfer."""

    PUBLISHED = "published"  # source holds the blocks pinned, waiting for a pull
    COMPLETED = "completed"  # destination confirmed; source released the pin
    RELEASED = "released"  # source released without a completion (abort or lease expiry)


@dataclass(frozen=True)
class KVHandle:
    """Where a request's prompt KV lives on its source engine.

    `num_tokens` prompt tokens have K/V in `block_ids` (in block-table order) on engine
    `engine_id`; `first_token_id` is the token the prefill sampled from the prompt's last logits.
    """

    request_id: str
    engine_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    first_token_id: int


class KVSource(ABC):
    """The source side of a transfer: an engine that can read and release pinned blocks."""

    @abstractmethod
    def read_kv(self, handle: KVHandle, first_block: int = 0) -> torch.Tensor:
        """K/V of the handle's blocks from `first_block` on:
        [num_layers, 2, len(block_ids) - first_block, block_size, num_kv_heads, head_dim].

        Raises RequestNotFoundError if the handle was already released, InvalidRequestError for a
        `first_block` outside the handle.
        """

    @abstractmethod
    def release_kv(self, request_id: str) -> None:
        """Unpin the request's blocks; a second call for the same request does nothing."""


class KVTransfer(ABC):
    """Moves pinned prompt blocks from a source engine to a destination engine."""

    @abstractmethod
    def register_source(self, engine_id: str, source: KVSource) -> None:
        """Make `source`'s handles pullable under `engine_id`."""

    @abstractmethod
    def publish(self, handle: KVHandle) -> None:
        """Source side: the handle's blocks are pinned and may be pulled."""

    @abstractmethod
    def pull(self, handle: KVHandle, first_block: int = 0) -> torch.Tensor:
        """Destination side: fetch the handle's blocks from `first_block` on (the ones before it
        are in the destination's own prefix cache); shape as `KVSource.read_kv`.

        Raises RequestNotFoundError for an unknown or released handle.
        """

    @abstractmethod
    def complete(self, handle: KVHandle) -> None:
        """Destination side: done with the handle (the KV landed, or the request was aborted
        before pulling); the source may free its blocks. Idempotent."""

    @abstractmethod
    def revoke(self, request_id: str) -> None:
        """Source side: the pin went away without a completion (abort); later pulls fail."""

    @abstractmethod
    def status(self, request_id: str) -> TransferStatus | None:
        """Current status of a request's transfer, or None if never published."""
