"""The paged KV cache: preallocated K/V tensors and per-request block tables.

Layout (vLLM's NHD paged layout): one tensor `kv` of shape
[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]; `kv[layer, 0]` is that layer's K
cache and `kv[layer, 1]` its V cache, each contiguous [num_blocks, block_size, num_kv_heads,
head_dim]. Token position `p` of a request lives in block `block_table[p // block_size]` at offset
`p % block_size`, i.e. flat slot `block_table[p // block_size] * block_size + p % block_size`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from services.engine.block_pool import BlockPool
from services.engine.request import Request


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape and dtype of one engine's KV cache; two engines exchange KV only if these match."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        """K and V of one block across all layers, in bytes."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    def num_blocks_for(self, memory_bytes: int) -> int:
        """Blocks that fit in `memory_bytes`; ValueError naming the field if not even one does."""
        if memory_bytes < self.bytes_per_block:
            raise ValueError(
                f"kv_cache_memory_bytes: {memory_bytes} bytes hold no block "
                f"({self.bytes_per_block} bytes each at block_size {self.block_size})"
            )
        return memory_bytes // self.bytes_per_block


class KVCache:
    """K/V tensors for all layers plus the block pool that manages their blocks."""

    def __init__(
        self, spec: KVCacheSpec, num_blocks: int, device: str, *, shuffle: bool = False, seed: int | None = 0
    ) -> None:
        self.spec = spec
        self.num_blocks = num_blocks
        shape = (spec.num_layers, 2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.kv = torch.zeros(shape, dtype=spec.dtype, device=device)
        self.pool = BlockPool(num_blocks, shuffle=shuffle, seed=seed)

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) of one layer, each [num_blocks, block_size, num_kv_heads, head_dim]."""
        return self.kv[layer_idx, 0], self.kv[layer_idx, 1]

    def num_blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        """Extra blocks `request` needs to hold `num_new_tokens` more tokens."""
        total = request.num_computed_tokens + num_new_tokens
        return max(0, math.ceil(total / self.spec.block_size) - len(request.block_table))

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Grow the block table to hold `num_new_tokens` more tokens; False (nothing taken) if short."""
        needed = self.num_blocks_needed(request, num_new_tokens)
        if needed > self.pool.num_free_blocks:
            return False
        block_ids = self.pool.allocate(needed)
        if block_ids:
            # Zero new blocks: slots a request has not written yet then hold finite values, which
            # decode attention masks without a copy (see attention._decode_attention).
            index = torch.tensor(block_ids, dtype=torch.long, device=self.kv.device)
            self.kv.index_fill_(2, index, 0)
        request.block_table.extend(block_ids)
        return True

    def free(self, request: Request) -> None:
        """Release the request's blocks (its one free path) and clear its block table."""
        self.pool.free(request.block_table)
        request.block_table = []

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Copy of the given blocks: [num_layers, 2, len(block_ids), block_size, num_kv_heads, head_dim]."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.kv.device)
        return self.kv.index_select(2, index)

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Write `data` (shape as `read_blocks` returns) into the given blocks."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.kv.device)
        self.kv.index_copy_(2, index, data.to(device=self.kv.device, dtype=self.kv.dtype))


def slot_mapping(block_table: list[int], start: int, end: int, block_size: int) -> torch.Tensor:
    """Flat cache slots of token positions [start, end) of one request: [end - start] long.

    slot = block_table[pos // block_size] * block_size + pos % block_size.
    """
    positions = torch.arange(start, end)
    return torch.tensor(block_table, dtype=torch.long)[positions // block_size] * block_size + positions % block_size
