"""Block pool and paged KV cache bookkeeping."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.engine.block_pool import BlockPool
from services.engine.errors import ResourceExhaustedError
from services.engine.kv_cache import KVCache, KVCacheSpec, slot_mapping
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
    spec = KVCacheSpec(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype=torch.float32)
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
    assert slot_mapping(table, 3, 6, 4).tolist() == [table[0] * 4 + 3, table[1] * 4, table[1] * 4 + 1]
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
