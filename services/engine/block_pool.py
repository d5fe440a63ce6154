"""Reference-counted pool of KV block ids (the block *ids*; tensors live in `KVCache`)."""

from __future__ import annotations

import random
from collections import deque

from services.engine.errors import ResourceExhaustedError


class BlockPool:
    """Hands out block ids from a free list and takes them back when their ref count drops to 0.

    A block is either free (ref count 0, in the free list) or used (ref count >= 1). Every
    allocation has exactly one path back: `free()` once per reference taken by `allocate()` or
    `incref()`. `shuffle=True` hands blocks out in a seeded random order, so a test catches any
    code that reads a block outside a request's own block table.
    """

    def __init__(self, num_blocks: int, *, shuffle: bool = False, seed: int | None = 0) -> None:
        assert num_blocks >= 1
        self.num_blocks = num_blocks
        order = list(range(num_blocks))
        if shuffle:
            random.Random(seed).shuffle(order)
        self._free: deque[int] = deque(order)
        self._ref_counts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` free blocks (ref count 1 each).

        Raises ResourceExhaustedError when fewer are free; nothing is taken then.
        """
        if num_blocks > len(self._free):
            raise ResourceExhaustedError(
                f"need {num_blocks} KV blocks, {len(self._free)} free of {self.num_blocks}"
            )
        block_ids = [self._free.popleft() for _ in range(num_blocks)]
        for block_id in block_ids:
            self._ref_counts[block_id] = 1
        return block_ids

    def incref(self, block_ids: list[int]) -> None:
        """Take one more reference on used blocks (sharing or pinning for a transfer)."""
        for block_id in block_ids:
            assert self._ref_counts[block_id] > 0, f"incref of free block {block_id}"
            self._ref_counts[block_id] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference per block; a block whose count reaches 0 goes back to the free list."""
        for block_id in block_ids:
            assert self._ref_counts[block_id] > 0, f"double free of block {block_id}"
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free.append(block_id)

    def check_integrity(self) -> None:
        """Raise RuntimeError unless free + used == total and ref counts match the free list."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise RuntimeError("free list holds a block twice")
        used = {b for b, count in enumerate(self._ref_counts) if count > 0}
        if free & used:
            raise RuntimeError(f"blocks both free and used: {sorted(free & used)[:8]}")
        if len(free) + len(used) != self.num_blocks:
            raise RuntimeError(
                f"free {len(free)} + used {len(used)} != total {self.num_blocks}"
            )
