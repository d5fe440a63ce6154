"""Decode attention over the paged cache: the C++ kernel and the torch path against dense math."""

from __future__ import annotations

import pytest
import torch

from services.engine.attention import (
    AttentionMetadata,
    CPUPagedBackend,
    PrefillSeq,
    TorchSDPABackend,
    get_attention_backend,
)
from services.engine.kernels import load_cpu_kernels

needs_kernel = pytest.mark.skipif(load_cpu_kernels() is None, reason="no C++ toolchain here")


def _case(dtype, num_heads, num_kv_heads, block_size, context_lens, head_dim=64, seed=0):
    """A random paged cache with NaN everywhere no request owns (and past each context), the
    requests' blocks scattered, plus the dense reference output."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in context_lens) + 7
    k_cache = torch.full(
        (num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype
    )
    v_cache = k_cache.clone()
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, expected = [], []
    q = torch.randn(len(context_lens), num_heads, head_dim, generator=gen).to(dtype)
    for b, n in enumerate(context_lens):
        table = [order.pop() for _ in range(-(-n // block_size))]
        tables.append(table)
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        for p in range(n):
            k_cache[table[p // block_size], p % block_size] = k[p]
            v_cache[table[p // block_size], p % block_size] = v[p]
        group = num_heads // num_kv_heads
        kf, vf = (
            t.double().repeat_interleave(group, dim=1) for t in (k, v)
        )  # [n, heads, head_dim]
        scores = torch.einsum("hd,nhd->hn", q[b].double(), kf) * head_dim**-0.5
        expected.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), vf))
    return q, k_cache, v_cache, tables, torch.stack(expected)


def _meta(tables, context_lens, block_size):
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [t[0]] * (width - len(t)) for t in tables])
    return AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.long),
        prefills=(),
        num_prefill_tokens=0,
        decode_block_tables=padded,
        decode_context_lens=torch.tensor(context_lens),
        block_size=block_size,
    )


TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 3e-3}


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("block_size", [1, 16])
def test_kernel_matches_dense_attention(dtype, num_heads, num_kv_heads, block_size):
    context_lens = [1, 15, 16, 17, 40, 3]
    q, k_cache, v_cache, tables, expected = _case(
        dtype, num_heads, num_kv_heads, block_size, context_lens
    )
    out = torch.empty_like(q)
    load_cpu_kernels().paged_decode_attention(
        out,
        q,
        k_cache,
        v_cache,
        _meta(tables, context_lens, block_size).decode_block_tables,
        torch.tensor(context_lens),
        64**-0.5,
    )
    assert not out.isnan().any(), "the kernel read a position outside a request's context"
    torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2, 3, 4])
@pytest.mark.parametrize(
    "context_lens,head_dim", [([2048], 64), ([1, 700, 1300], 64), ([900, 5], 80), ([300], 128)]
)
def test_kernel_splits_long_contexts_into_parts_across_threads(threads, context_lens, head_dim):
    """Fewer requests than threads: each context is cut into parts of whole blocks, computed
    apart and merged by their softmax maxima and sums; the result is the dense one at any thread
    count, whole rows or parts."""
    import threading

    from services.engine.threads import set_thread_threads

    q, k_cache, v_cache, tables, expected = _case(
        torch.float32, 9, 3, 16, context_lens, head_dim=head_dim
    )
    out = torch.empty_like(q)

    def run() -> None:
        set_thread_threads(threads)
        load_cpu_kernels().paged_decode_attention(
            out, q, k_cache, v_cache, _meta(tables, context_lens, 16).decode_block_tables,
            torch.tensor(context_lens), head_dim**-0.5,
        )  # fmt: skip

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    assert not out.isnan().any(), "the kernel read a position outside a request's context"
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize(
    "head_dim", [32, 128, 80]
)  # 64 and 128 have unrolled paths, the rest a generic one
def test_kernel_handles_every_head_dim(head_dim):
    context_lens = [1, 16, 33]
    q, k_cache, v_cache, tables, expected = _case(
        torch.float32, 6, 2, 16, context_lens, head_dim=head_dim
    )
    out = torch.empty_like(q)
    load_cpu_kernels().paged_decode_attention(
        out,
        q,
        k_cache,
        v_cache,
        _meta(tables, context_lens, 16).decode_block_tables,
        torch.tensor(context_lens),
        head_dim**-0.5,
    )
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_path_matches_dense_attention(dtype):
    context_lens = [1, 15, 16, 17, 40]
    block_size = 16
    q, k_cache, v_cache, tables, expected = _case(dtype, 9, 3, block_size, context_lens)
    # The torch path reads whole padded blocks; the engine zeroes blocks when it allocates them.
    owned = sorted({b for t in tables for b in t})
    for cache in (k_cache, v_cache):
        cache[owned] = torch.nan_to_num(cache[owned], nan=0.0)
    out = TorchSDPABackend()._decode(
        q, k_cache, v_cache, _meta(tables, context_lens, block_size), 64**-0.5
    )
    torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_backend_choice(monkeypatch):
    assert isinstance(get_attention_backend("torch_sdpa", "cpu"), TorchSDPABackend)
    with pytest.raises(ValueError, match="attention_backend"):
        get_attention_backend("flash", "cpu")
    with pytest.raises(ValueError, match="attention_backend"):
        get_attention_backend("cpu_paged", "cuda")
    if load_cpu_kernels() is not None:
        assert isinstance(get_attention_backend("auto", "cpu"), CPUPagedBackend)
    # Without a toolchain "auto" falls back to the torch path rather than failing.
    monkeypatch.setattr("services.engine.kernels.load_cpu_kernels", lambda: None)
    backend = get_attention_backend("auto", "cpu")
    assert type(backend) is TorchSDPABackend


def test_a_stale_build_lock_is_cleared(tmp_path):
    """A lock left by a killed build would make torch's builder wait forever."""
    import os

    from services.engine.kernels import STALE_LOCK_S, _clear_stale_lock

    lock = tmp_path / "lock"
    lock.touch()
    _clear_stale_lock(lock)
    assert lock.exists()  # a fresh lock belongs to a build in progress
    old = lock.stat().st_mtime - STALE_LOCK_S - 1
    os.utime(lock, (old, old))
    _clear_stale_lock(lock)
    assert not lock.exists()


@needs_kernel
def test_kernel_refuses_out_of_range_inputs():
    q, k_cache, v_cache, tables, _ = _case(torch.float32, 4, 2, 16, [5])
    kernel = load_cpu_kernels().paged_decode_attention
    out = torch.empty_like(q)
    with pytest.raises(RuntimeError, match="block id"):
        kernel(out, q, k_cache, v_cache, torch.tensor([[k_cache.shape[0]]]), torch.tensor([5]), 0.1)
    with pytest.raises(RuntimeError, match="context length"):
        kernel(out, q, k_cache, v_cache, torch.tensor([tables[0]]), torch.tensor([17]), 0.1)
    with pytest.raises(RuntimeError, match="dtype"):
        kernel(
            out,
            q,
            k_cache.bfloat16(),
            v_cache.bfloat16(),
            torch.tensor([tables[0]]),
            torch.tensor([5]),
            0.1,
        )


def test_fresh_prompts_apart_in_the_batch_are_gathered_by_index():
    """Two fresh 4-token prompts with a cached prompt's 4-token chunk between them: one group,
    its rows by index (a slice only where the group sits back to back)."""
    table = torch.tensor([0, 1])
    prefills = (
        PrefillSeq(query_start=0, query_len=4, context_len=4, block_table=table),
        PrefillSeq(query_start=4, query_len=4, context_len=10, block_table=table),
        PrefillSeq(query_start=8, query_len=4, context_len=4, block_table=table),
    )
    meta = AttentionMetadata(
        slot_mapping=torch.arange(12),
        prefills=prefills,
        num_prefill_tokens=12,
        decode_block_tables=torch.empty(0, 1, dtype=torch.long),
        decode_context_lens=torch.empty(0, dtype=torch.long),
        block_size=8,
    )
    ((rows, num_seqs),) = meta.fresh_prefill_groups
    assert num_seqs == 2 and rows.tolist() == [0, 1, 2, 3, 8, 9, 10, 11]
