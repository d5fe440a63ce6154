"""Reference-counted pool of KV block ids, with the prefix cache's hash index and LRU eviction.

The block *ids* live here; their tensors live in `KVCache`. The design follows vLLM v1's
BlockPool: a full block can carry a content hash (`block_hash.hash_block`); when its last
reference goes it stays cached (reusable by any request whose prefix hashes to it) until an
allocation needs the space and evicts it, least recently freed first.
"""

from __future__ import annotations

import random
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

from services.engine.block_hash import BlockHash
from services.engine.errors import ResourceExhaustedError
from services.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


class BlockPool:
    """Every block is in exactly one state:

    - free: ref count 0, no hash, in the free list;
    - cached: ref count 0, holds a hash, in the LRU of evictable blocks;
    - used: ref count >= 1 (it may hold a hash, then other requests can share it).

    Every reference has exactly one path back: `free()` once per reference taken by `allocate()`
    or `incref()`. Allocation takes free blocks first, then evicts the least recently freed cached
    block, which loses its hash before it is handed out. `shuffle=True` hands blocks out in a
    seeded random order, so a test catches any code that reads outside a request's block table.
    `events` (when not None) receives a `KVEvent` for every hash stored, evicted or cleared.
    """

    def __init__(
        self,
        num_blocks: int,
        *,
        shuffle: bool = False,
        seed: int | None = 0,
        record_events: bool = False,
    ) -> None:
        assert num_blocks >= 1
        self.num_blocks = num_blocks
        order = list(range(num_blocks))
        if shuffle:
            random.Random(seed).shuffle(order)
        self._free: deque[int] = deque(order)
        self._evictable: OrderedDict[int, None] = (
            OrderedDict()
        )  # cached, unreferenced; oldest first
        self._ref_counts = [0] * num_blocks
        self._hash_of: list[BlockHash | None] = [None] * num_blocks
        self._cached: dict[BlockHash, int] = {}  # hash -> the block holding it
        self.events: list[KVEvent] | None = [] if record_events else None

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now: free plus cached-but-unreferenced."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Unreferenced blocks that still hold a cached prefix (evictable)."""
        return len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def block_hash(self, block_id: int) -> BlockHash | None:
        return self._hash_of[block_id]

    # -- allocation ----------------------------------------------------------------------------

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` blocks without a hash (ref count 1 each), evicting cached ones (LRU)
        when the free list runs short. Raises ResourceExhaustedError when fewer than
        `num_blocks` are free or cached; nothing is taken then."""
        if num_blocks > self.num_free_blocks:
            raise ResourceExhaustedError(
                f"need {num_blocks} KV blocks, {self.num_free_blocks} free of {self.num_blocks}"
            )
        block_ids = []
        for _ in range(num_blocks):
            if not self._free:
                self.evict(next(iter(self._evictable)))
            block_ids.append(self._free.popleft())
        for block_id in block_ids:
            self._ref_counts[block_id] = 1
        return block_ids

    def incref(self, block_ids: Sequence[int]) -> None:
        """Take one more reference on used or cached blocks (a prefix-cache hit, or pinning for a
        transfer); a cached block leaves the LRU and cannot be evicted until freed again."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                assert block_id in self._evictable, f"incref of free block {block_id}"
                del self._evictable[block_id]
            self._ref_counts[block_id] += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference per block. At 0 a block with a hash becomes cached (most recently
        used end of the LRU), any other block free. Callers pass a request's blocks tail first
        (vLLM's order) so that, among one request's blocks, the end of a prefix is evicted before
        its beginning."""
        for block_id in block_ids:
            assert self._ref_counts[block_id] > 0, f"double free of block {block_id}"
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                if self._hash_of[block_id] is not None:
                    self._evictable[block_id] = None
                else:
                    self._free.append(block_id)

    @contextmanager
    def borrow(self, num_blocks: int) -> Iterator[list[int]]:
        """`num_blocks` free blocks (ref count 1 each) for a forward that must leave no trace
        (the engine's warm-up): only never-cached blocks are taken, so nothing is evicted and no
        event recorded, and on exit they go back to the front of the free list in their order,
        so the pool hands out the same blocks next as if they had never been taken. The caller
        must not hash or share them. Raises ResourceExhaustedError when fewer than `num_blocks`
        blocks are on the free list; nothing is taken then."""
        if num_blocks > len(self._free):
            raise ResourceExhaustedError(
                f"need {num_blocks} free KV blocks to borrow, the free list holds {len(self._free)}"
            )
        block_ids = [self._free.popleft() for _ in range(num_blocks)]
        for block_id in block_ids:
            self._ref_counts[block_id] = 1
        try:
            yield block_ids
        finally:
            for block_id in block_ids:
                assert self._ref_counts[block_id] == 1 and self._hash_of[block_id] is None
                self._ref_counts[block_id] = 0
            self._free.extendleft(reversed(block_ids))

    # -- the prefix cache ----------------------------------------------------------------------

    def lookup(self, block_hashes: Sequence[BlockHash]) -> list[int]:
        """Blocks holding the longest cached run of `block_hashes` from the first; the run stops
        at the first hash not cached (a chained hash after a miss cannot be trusted to mean the
        same prefix in this pool). Takes no references."""
        block_ids = []
        for block_hash in block_hashes:
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids

    def cache_blocks(
        self,
        block_ids: Sequence[int],
        block_hashes: Sequence[BlockHash],
        parent: BlockHash,
        token_ids: Sequence[int],
        block_size: int,
    ) -> None:
        """Give used, full blocks their hashes (`block_ids[i]` holds `token_ids[i*block_size:
        (i+1)*block_size]` and hashes to `block_hashes[i]`; the first block's parent hash is
        `parent`). A hash some other block already holds is left with that block."""
        run: list[int] = []  # indices of a consecutive run of newly stored blocks, for one event
        for i, (block_id, block_hash) in enumerate(zip(block_ids, block_hashes, strict=True)):
            assert self._ref_counts[block_id] > 0, f"caching unreferenced block {block_id}"
            stored = self._hash_of[block_id] is None and block_hash not in self._cached
            if stored:
                self._hash_of[block_id] = block_hash
                self._cached[block_hash] = block_id
                run.append(i)
            if run and (not stored or i == len(block_ids) - 1):
                self._record_stored(run, block_hashes, parent, token_ids, block_size)
                run = []

    def _record_stored(self, run, block_hashes, parent, token_ids, block_size) -> None:
        if self.events is None:
            return
        first, last = run[0], run[-1]
        self.events.append(
            BlockStored(
                tuple(block_hashes[first : last + 1]),
                block_hashes[first - 1] if first else parent,
                tuple(token_ids[first * block_size : (last + 1) * block_size]),
                block_size,
            )
        )

    def cached_hashes(self) -> list[BlockHash]:
        """Every hash the prefix cache holds now (of cached and of in-use blocks)."""
        return list(self._cached)

    def evict(self, block_id: int) -> bool:
        """Drop the hash of an unreferenced cached block and make it free; False (nothing done)
        if the block is not cached or is in use."""
        if block_id not in self._evictable:
            return False
        del self._evictable[block_id]
        block_hash = self._hash_of[block_id]
        assert block_hash is not None
        del self._cached[block_hash]
        self._hash_of[block_id] = None
        self._free.append(block_id)
        if self.events is not None:
            self.events.append(BlockRemoved((block_hash,)))
        return True

    def reset_prefix_cache(self) -> int:
        """Forget every hash (blocks in use keep their data but can no longer be shared); returns
        how many hashes were dropped."""
        num_hashes = len(self._cached)
        for block_id in self._cached.values():
            self._hash_of[block_id] = None
        self._cached.clear()
        self._free.extend(self._evictable)
        self._evictable.clear()
        if self.events is not None:
            self.events.append(AllBlocksCleared())
        return num_hashes

    def take_events(self) -> list[KVEvent]:
        """Prefix-cache events since the last call, oldest first (empty unless recording)."""
        if not self.events:
            return []
        taken, self.events = self.events, []
        return taken

    def check_holders(self, block_tables: Iterable[Sequence[int]]) -> None:
        """Raise RuntimeError unless every block's ref count is the number of times the given
        block tables (every request holding blocks) hold it."""
        refs = Counter(b for table in block_tables for b in table)
        wrong = [b for b in range(self.num_blocks) if refs[b] != self.ref_count(b)]
        if wrong:
            b = wrong[0]
            raise RuntimeError(
                f"requests hold block {b} {refs[b]} times, its ref count is {self.ref_count(b)}"
            )

    def check_integrity(self) -> None:
        """Raise RuntimeError unless free + cached + used == total, ref counts match the states,
        and the hash index matches the blocks' hashes."""
        free, cached = set(self._free), set(self._evictable)
        if len(free) != len(self._free):
            raise RuntimeError("free list holds a block twice")
        used = {b for b, count in enumerate(self._ref_counts) if count > 0}
        for name, group in (
            ("free and cached", free & cached),
            ("free and used", free & used),
            ("cached and used", cached & used),
        ):
            if group:
                raise RuntimeError(f"blocks both {name}: {sorted(group)[:8]}")
        if len(free) + len(cached) + len(used) != self.num_blocks:
            raise RuntimeError(
                f"free {len(free)} + cached {len(cached)} + used {len(used)} "
                f"!= total {self.num_blocks}"
            )
        if any(self._hash_of[b] is not None for b in free) or any(
            self._hash_of[b] is None for b in cached
        ):
            raise RuntimeError("a free block holds a hash, or a cached block holds none")
        hashed = {b: h for b, h in enumerate(self._hash_of) if h is not None}
        if {h: b for b, h in hashed.items()} != self._cached:
            raise RuntimeError("the hash index does not match the blocks' hashes")
