"""The paged KV cache: preallocated K/V tensors and per-request block tables.

Layout (vLLM's NHD paged layout): one tensor `kv` of shape
[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]; `kv[layer, 0]` is that layer's K
cache and `kv[layer, 1]` its V cache, each contiguous [num_blocks, block_size, num_kv_heads,
head_dim]. Token position `p` of a request lives in block `block_table[p // block_size]` at offset
`p % block_size`, i.e. flat slot `block_table[p // block_size] * block_size + p % block_size`.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from services.engine.block_hash import ROOT_HASH, BlockHash, block_hashes
from services.engine.block_pool import BlockPool
from services.engine.errors import InvalidRequestError
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

    def check_transfer(self, data: torch.Tensor, num_blocks: int) -> None:
        """Transferred KV must have exactly this layout for `num_blocks` blocks (no silent
        reshapes or casts); raises InvalidRequestError naming `kv_handle` otherwise."""
        want = (self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        if tuple(data.shape) != want or data.dtype != self.dtype:
            raise InvalidRequestError(
                "kv_handle",
                f"KV layout {tuple(data.shape)} {data.dtype} does not match {want} {self.dtype}",
            )

    def num_blocks_for(self, memory_bytes: int) -> int:
        """Blocks that fit in `memory_bytes`; ValueError naming the field if not even one does."""
        if memory_bytes < self.bytes_per_block:
            raise ValueError(
                f"kv_cache_memory_bytes: {memory_bytes} bytes hold no block "
                f"({self.bytes_per_block} bytes each at block_size {self.block_size})"
            )
        return memory_bytes // self.bytes_per_block


class KVCache:
    """K/V tensors for all layers, the block pool that manages their blocks, and the per-request
    operations on both: prefix-cache lookups, slot allocation, caching full blocks, freeing.

    Prefix caching (vLLM v1's automatic prefix caching) is on when `model_id` is given: every
    full block a request has computed gets its chained hash (`block_hash`, keyed by `model_id`
    and the request's `cache_salt`) and stays reusable after the request frees it.
    """

    def __init__(
        self,
        spec: KVCacheSpec,
        num_blocks: int,
        device: str,
        *,
        shuffle: bool = False,
        seed: int | None = 0,
        model_id: str | None = None,
        record_events: bool = False,
        allocate: Callable[[tuple[int, ...], torch.dtype, str], torch.Tensor] | None = None,
    ) -> None:
        """`allocate(shape, dtype, device)` makes the zero-filled K/V tensor (default
        `zeroed_kv`; a shared-memory KV sender puts it in a segment decode workers map)."""
        self.spec = spec
        self.num_blocks = num_blocks
        self.model_id = model_id
        shape = (spec.num_layers, 2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.kv = (allocate or zeroed_kv)(shape, spec.dtype, device)
        self.pool = BlockPool(num_blocks, shuffle=shuffle, seed=seed, record_events=record_events)

    @property
    def prefix_caching(self) -> bool:
        return self.model_id is not None

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) of one layer, each
        [num_blocks, block_size, num_kv_heads, head_dim]."""
        return self.kv[layer_idx, 0], self.kv[layer_idx, 1]

    def block_hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """The first `num_blocks` full-block hashes of the request's tokens (computed once each,
        kept on the request)."""
        assert self.model_id is not None
        if len(request.block_hashes) < num_blocks:
            tokens = request.all_token_ids[: num_blocks * self.spec.block_size]
            request.block_hashes = block_hashes(
                tokens,
                self.spec.block_size,
                self.model_id,
                request.cache_salt,
                known=request.block_hashes,
            )
        return request.block_hashes[:num_blocks]

    def get_computed_blocks(self, request: Request, max_blocks: int) -> list[int]:
        """Cached blocks holding the request's longest cached prefix, at most `max_blocks` of them
        (the caller keeps the tokens it must recompute out of reach). Takes no references."""
        if not self.prefix_caching or max_blocks <= 0:
            return []
        return self.pool.lookup(self.block_hashes(request, max_blocks))

    def allocate_slots(
        self, request: Request, num_new_tokens: int, cached_blocks: Sequence[int] = ()
    ) -> bool:
        """Grow the block table to hold `num_new_tokens` more tokens; False (nothing taken) if
        short.

        `cached_blocks` (from `get_computed_blocks`, for a request with no blocks yet) start the
        table as shared references; the new tokens then follow them. Cached blocks nobody else
        holds are counted as taken, never as room for the new ones.
        """
        if cached_blocks:
            assert not request.block_table and request.num_computed_tokens == 0
        start = len(cached_blocks) * self.spec.block_size + request.num_computed_tokens
        needed = max(
            0,
            math.ceil((start + num_new_tokens) / self.spec.block_size)
            - len(request.block_table)
            - len(cached_blocks),
        )
        reused = sum(1 for block_id in cached_blocks if self.pool.ref_count(block_id) == 0)
        if needed > self.pool.num_free_blocks - reused:
            return False
        if cached_blocks:
            self.pool.incref(cached_blocks)
            request.block_table.extend(cached_blocks)
            request.num_hashed_blocks = len(cached_blocks)  # they hold their hashes already
        block_ids = self.pool.allocate(needed)
        if block_ids:
            # Zero new blocks: slots a request has not written yet then hold finite values, which
            # decode attention masks without a copy (see attention._decode_attention).
            index = torch.tensor(block_ids, dtype=torch.long, device=self.kv.device)
            self.kv.index_fill_(2, index, 0)
        request.block_table.extend(block_ids)
        return True

    def cache_full_blocks(self, request: Request) -> None:
        """Offer the request's newly completed full blocks (by `num_computed_tokens`) to the
        prefix cache. A no-op with prefix caching off."""
        if not self.prefix_caching:
            return
        block_size = self.spec.block_size
        first, num_full = request.num_hashed_blocks, request.num_computed_tokens // block_size
        if num_full <= first:
            return
        hashes = self.block_hashes(request, num_full)
        self.pool.cache_blocks(
            request.block_table[first:num_full],
            hashes[first:],
            hashes[first - 1] if first else ROOT_HASH,
            request.all_token_ids[first * block_size : num_full * block_size],
            block_size,
        )
        request.num_hashed_blocks = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks (its one free path), tail first, and clear its block
        table."""
        self.pool.free(request.block_table[::-1])
        request.block_table = []
        request.num_hashed_blocks = 0

    def read_blocks(self, block_ids: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """Copy of the given blocks:
        [num_layers, 2, len(block_ids), block_size, num_kv_heads, head_dim] (into `out`, a
        contiguous tensor of that shape, when given)."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.kv.device)
        if out is None:
            return self.kv.index_select(2, index)
        return torch.index_select(self.kv, 2, index, out=out)

    def block_buffers(self, block_ids: list[int]) -> list[memoryview]:
        """The given blocks' bytes in `read_blocks` order, as views of the cache where it lives
        in CPU memory (a copy first on another device): for each layer, K then V, each run of
        consecutive block ids as one contiguous buffer. Only valid while the blocks stay
        allocated to their owner (the caller guarantees it)."""
        if self.kv.device.type != "cpu":
            array = _as_numpy(self.read_blocks(block_ids).cpu())
            runs = [(0, len(block_ids))]
        else:
            array, runs = _as_numpy(self.kv), block_runs(block_ids)
        return [
            # numpy's stubs give ndarray `__buffer__` only from Python 3.12; it has one on all.
            memoryview(array[layer, k, start : start + n])  # type: ignore[arg-type]
            for layer in range(array.shape[0])
            for k in (0, 1)
            for start, n in runs
        ]

    def write_transferred(self, block_ids: Sequence[int], offset: int, piece: torch.Tensor) -> int:
        """Write one transferred piece of KV ([num_layers, 2, n, ...]) into `block_ids[offset:
        offset + n]`; returns `offset + n`. Raises InvalidRequestError (naming `kv_handle`) when
        its layout is not exactly this cache's or it runs past `block_ids`."""
        num_blocks = piece.shape[2]
        self.spec.check_transfer(piece, min(num_blocks, len(block_ids) - offset))
        self.write_blocks(list(block_ids[offset : offset + num_blocks]), piece)
        return offset + num_blocks

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Write `data` (shape as `read_blocks` returns, this cache's dtype) into the given
        blocks. On the CPU the copy is numpy's, one run of consecutive blocks at a time: it
        starts no intra-op thread pool, so a thread other than the engine's may call it
        without taking the engine's cores."""
        if self.kv.device.type != "cpu" or data.device.type != "cpu" or data.dtype != self.kv.dtype:
            index = torch.tensor(block_ids, dtype=torch.long, device=self.kv.device)
            self.kv.index_copy_(2, index, data.to(device=self.kv.device, dtype=self.kv.dtype))
            return
        cache, source, offset = _as_numpy(self.kv), _as_numpy(data), 0
        for start, n in block_runs(block_ids):
            np.copyto(cache[:, :, start : start + n], source[:, :, offset : offset + n])
            offset += n


def zeroed_kv(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    """A zero-filled tensor of `shape`. On the CPU its memory is an anonymous mapping, whose
    pages the kernel zero-fills as the cache first touches them: a 1 GiB cache costs no start-up
    time and no resident memory until it is used (as the shared-memory segment's pages). On
    other devices `torch.zeros`."""
    nbytes = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    buffer = mmap.mmap(-1, nbytes)  # the tensor keeps the mapping alive
    return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).view(shape)


def block_runs(block_ids: list[int]) -> list[tuple[int, int]]:
    """Runs of consecutive ids as (first id, count), in order."""
    runs: list[tuple[int, int]] = []
    for block_id in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == block_id:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((block_id, 1))
    return runs


def _as_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor (bfloat16 as int16: numpy has no bfloat16, same bytes)."""
    return (tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor).numpy()


def slot_mapping(block_table: list[int], start: int, end: int, block_size: int) -> torch.Tensor:
    """Flat cache slots of token positions [start, end) of one request: [end - start] long.

    slot = block_table[pos // block_size] * block_size + pos % block_size.
    """
    positions = torch.arange(start, end)
    return (
        torch.tensor(block_table, dtype=torch.long)[positions // block_size] * block_size
        + positions % block_size
    )
