"""Prefix-cache events: what a worker's cache gained and lost, for an external prefix index.

The engine records them when `EngineConfig.enable_kv_events` is set and hands them out with
`Engine.take_kv_events()`, in the order they happened (vLLM's KVEventBatch carries the same three
kinds). A consumer that applies them in order knows exactly which block hashes the worker holds.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.engine.block_hash import BlockHash


@dataclass(frozen=True)
class BlockStored:
    """Consecutive full blocks of one sequence entered the prefix cache.

    `block_hashes[i]` covers `token_ids[i * block_size:(i + 1) * block_size]`; the first block's
    parent is `parent_block_hash` (`block_hash.ROOT_HASH` for a sequence's first block).
    """

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash
    token_ids: tuple[int, ...]
    block_size: int


@dataclass(frozen=True)
class BlockRemoved:
    """These hashes left the prefix cache (evicted for reuse, or evicted by an operator)."""

    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    """The prefix cache was reset: no hash it held before is cached any more."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
