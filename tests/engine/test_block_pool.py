"""Block pool and paged KV cache bookkeeping."""

from __future__ import annotations

import gc

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.engine.block_pool import BlockPool
from services.engine.errors import ResourceExhaustedError
from services.engine.kv_cache import KVCache, KVCacheSpec, slot_mapping, zeroed_kv
from services.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from services.engine.request import Request
from services.engine.sampling_params import SamplingParams


def test_allocate_free_and_integrity():
    pool = BlockPool(8)
    a = pool.allocate(3)
    b = pool.allocate(5)
    assert len(set(a + b)) == 8 and pool.num_free_blocks == 0
    with pytest.raises(ResourceExhaustedError):
        pool.allocate(1)
    pool.incref(a)
    pool.free(a)
    assert pool.num_free_blocks == 0  # still referenced once
    pool.free(a + b)
    assert pool.num_free_blocks == 8
    pool.check_integrity()
    with pytest.raises(AssertionError, match="double free"):
        pool.free(a[:1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_cache_memory_is_zero_writable_and_outlives_its_mapping_name(dtype):
    """zeroed_kv's anonymous mapping: zeros, of the asked shape and dtype, writable; the tensor
    keeps the mapping alive (no name of it left but the tensor's)."""
    kv = zeroed_kv((2, 2, 8, 16, 3, 4), dtype, "cpu")
    gc.collect()
    assert (kv.shape, kv.dtype) == ((2, 2, 8, 16, 3, 4), dtype)
    assert not kv.any()
    kv[1, 0, 7, 15] = 2.5
    kv[0, 1, 0, 0, 0, 0] = -1.0
    assert float(kv.sum()) == 2.5 * 12 - 1.0
    assert not zeroed_kv((0, 4), dtype, "cpu").numel()


def test_shuffled_free_list_is_seeded_and_not_sequential():
    first = BlockPool(64, shuffle=True, seed=3).allocate(64)
    assert first == BlockPool(64, shuffle=True, seed=3).allocate(64)
    assert first != list(range(64)) and sorted(first) == list(range(64))


@settings(max_examples=50, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(1, 6)), max_size=60))
def test_random_allocate_free_sequences_keep_integrity(ops):
    pool = BlockPool(16, shuffle=True)
    held: list[list[int]] = []
    for is_alloc, n in ops:
        if is_alloc and n <= pool.num_free_blocks:
            held.append(pool.allocate(n))
        elif held:
            pool.free(held.pop(n % len(held)))
        pool.check_integrity()
        assert pool.num_used_blocks == sum(map(len, held))


def test_num_blocks_from_memory_budget():
    spec = KVCacheSpec(
        num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype=torch.float32
    )
    assert spec.bytes_per_block == 2 * 30 * 16 * 3 * 64 * 4
    assert spec.num_blocks_for(1 << 30) == (1 << 30) // spec.bytes_per_block


def test_slot_mapping_and_block_growth():
    spec = KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=4, block_size=4, dtype=torch.float32)
    cache = KVCache(spec, num_blocks=10, device="cpu")
    request = Request("r", list(range(6)), SamplingParams(), seed=0)
    assert cache.allocate_slots(request, 6) and len(request.block_table) == 2
    request.num_computed_tokens = 6
    assert cache.allocate_slots(request, 2) and len(request.block_table) == 2  # fits in block 2
    request.num_computed_tokens = 8
    assert cache.allocate_slots(request, 1) and len(request.block_table) == 3
    table = request.block_table
    assert slot_mapping(table, 3, 6, 4).tolist() == [
        table[0] * 4 + 3,
        table[1] * 4,
        table[1] * 4 + 1,
    ]
    assert not cache.allocate_slots(request, 36)  # needs 8 more blocks, 7 are free: nothing taken
    assert len(request.block_table) == 3
    cache.free(request)
    assert cache.pool.num_free_blocks == 10 and request.block_table == []


def test_read_write_blocks_roundtrip():
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=4, block_size=2, dtype=torch.float32)
    cache = KVCache(spec, num_blocks=6, device="cpu")
    data = torch.randn(2, 2, 3, 2, 2, 4)
    cache.write_blocks([5, 0, 3], data)
    assert torch.equal(cache.read_blocks([5, 0, 3]), data)
    assert torch.equal(cache.kv[:, :, 1], torch.zeros(2, 2, 2, 2, 4))


# -- the prefix cache's states: free, cached (hash, unreferenced), used ------------------------


def _hashes(n: int, tag: bytes = b"") -> list[bytes]:
    return [bytes([i]) * 31 + tag[:1].ljust(1, b"\0") for i in range(n)]


def _cached_run(pool: BlockPool, n: int, tag: bytes = b"") -> tuple[list[int], list[bytes]]:
    """Allocate n blocks, give them a chain of hashes, free them (tail first): all cached."""
    blocks, hashes = pool.allocate(n), _hashes(n, tag)
    pool.cache_blocks(blocks, hashes, b"root", list(range(n * 2)), 2)
    pool.free(blocks[::-1])
    return blocks, hashes


def test_freed_hashed_blocks_stay_cached_until_evicted_lru_first():
    pool = BlockPool(4, record_events=True)
    blocks, hashes = _cached_run(pool, 3)
    assert (pool.num_cached_blocks, pool.num_free_blocks, pool.num_used_blocks) == (3, 4, 0)
    assert pool.lookup(hashes) == blocks
    # The free block goes first; then the least recently freed cached block (the chain's tail).
    first = pool.allocate(1)
    assert first not in blocks and pool.lookup(hashes) == blocks
    second = pool.allocate(1)
    assert second == [blocks[2]] and pool.block_hash(blocks[2]) is None  # evicted: hash gone first
    assert pool.lookup(hashes) == blocks[:2]
    assert pool.events[-1] == BlockRemoved((hashes[2],))
    pool.check_integrity()


def test_hit_takes_cached_blocks_out_of_the_lru():
    pool = BlockPool(3)
    blocks, hashes = _cached_run(pool, 2)
    pool.incref(pool.lookup(hashes))  # a request reuses both
    assert (pool.num_cached_blocks, pool.num_free_blocks) == (0, 1)
    with pytest.raises(ResourceExhaustedError):
        pool.allocate(2)  # referenced cached blocks are never evicted
    pool.free(blocks[::-1])
    assert pool.num_cached_blocks == 2
    pool.check_integrity()


def test_lookup_stops_at_the_first_missing_hash():
    pool = BlockPool(8)
    blocks, hashes = _cached_run(pool, 3)
    assert pool.evict(blocks[1]) and not pool.evict(blocks[1])
    assert pool.lookup(hashes) == blocks[:1]  # block 2 is still cached but unreachable
    assert pool.block_hash(blocks[2]) == hashes[2]


def test_a_hash_held_by_another_block_is_not_stored_twice():
    pool = BlockPool(4, record_events=True)
    blocks, hashes = _cached_run(pool, 2)
    again = pool.allocate(2)
    pool.cache_blocks(again, [hashes[0], b"x" * 32], b"root", [9, 9, 8, 8], 2)
    assert pool.block_hash(again[0]) is None and pool.block_hash(again[1]) == b"x" * 32
    assert pool.events[-1] == BlockStored((b"x" * 32,), hashes[0], (8, 8), 2)
    pool.free(again)
    pool.check_integrity()


def test_reset_prefix_cache_forgets_every_hash():
    pool = BlockPool(4, record_events=True)
    _, hashes = _cached_run(pool, 2)
    used = pool.allocate(1)
    pool.cache_blocks(used, [b"u" * 32], b"root", [1, 2], 2)
    assert pool.reset_prefix_cache() == 3
    assert (
        pool.lookup(hashes) == [] and pool.lookup([b"u" * 32]) == [] and pool.num_cached_blocks == 0
    )
    assert isinstance(pool.events[-1], AllBlocksCleared)
    pool.free(used)
    assert pool.num_free_blocks == 4
    pool.check_integrity()


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from("acfle"), st.integers(0, 7)), max_size=80))
def test_random_prefix_cache_operations_keep_integrity(ops):
    """allocate / cache / free / lookup+reuse / evict in any order: the states stay consistent,
    allocation never hands out a block with a hash, and a lookup returns blocks that hold the
    looked-up hashes, in order."""
    pool = BlockPool(12, shuffle=True)
    held: list[list[int]] = []
    chain = _hashes(8, b"c")
    for op, n in ops:
        if op == "a" and 1 <= n <= pool.num_free_blocks:
            blocks = pool.allocate(n)
            assert all(pool.block_hash(b) is None for b in blocks)
            held.append(blocks)
        elif op == "c" and held:
            blocks = held[n % len(held)]
            k = min(len(blocks), len(chain))
            pool.cache_blocks(blocks[:k], chain[:k], b"root", list(range(2 * k)), 2)
        elif op == "f" and held:
            pool.free(held.pop(n % len(held))[::-1])
        elif op == "l":
            hits = pool.lookup(chain[: n + 1])
            assert [pool.block_hash(b) for b in hits] == chain[: len(hits)]
            if hits:
                pool.incref(hits)
                held.append(hits)
        elif op == "e":
            pool.evict(n)
        pool.check_integrity()
        assert pool.num_used_blocks == len({b for blocks in held for b in blocks})


def test_borrowed_blocks_go_back_as_if_never_taken():
    order = BlockPool(8, shuffle=True, seed=5).allocate(8)
    pool = BlockPool(8, shuffle=True, seed=5)
    with pool.borrow(3) as borrowed:
        assert borrowed == order[:3] and pool.num_free_blocks == 5
        assert all(pool.ref_count(b) == 1 for b in borrowed)
        pool.check_integrity()
    assert pool.allocate(8) == order  # allocate + free would have put them at the end


def test_borrow_takes_no_cached_block_and_records_no_event():
    pool = BlockPool(4, record_events=True)
    blocks, hashes = _cached_run(pool, 3)
    events = list(pool.events or [])
    with pytest.raises(ResourceExhaustedError, match="the free list holds 1$"):
        with pool.borrow(2):
            pass
    with pool.borrow(1) as borrowed:
        assert borrowed[0] not in blocks
    assert pool.lookup(hashes) == blocks and pool.events == events
    pool.check_integrity()
