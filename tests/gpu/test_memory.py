"""--gpu-memory-utilization bounds what the device holds: the engine sizes its KV cache from a
profiling forward so that the device's whole use (this process's weights, activations, cache
and CUDA graphs, and anything else already on it) stays within the fraction, as vLLM's flag."""

from __future__ import annotations

import gc

import torch

from tests.gpu.models import GPU, PROMPTS, engine_greedy, engine_llm, small_llama

pytestmark = GPU

UTILIZATION = 0.3
# What the profiling forward does not see: the CUDA graphs' pool and the allocator's rounding.
SLACK = 512 << 20


def test_gpu_memory_utilization_bounds_the_device_memory() -> None:
    gc.collect()
    torch.cuda.empty_cache()
    llm = engine_llm(
        small_llama(), num_blocks=None, max_num_seqs=16, gpu_memory_utilization=UTILIZATION
    )
    engine = llm.engine
    engine.warm_up()
    engine_greedy(llm, PROMPTS * 3)  # 15 requests: graphs of 16, a full prefill step
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    cache_bytes = engine.kv_cache.num_blocks * engine.kv_cache.spec.bytes_per_block
    used = total - free
    print(
        f"  at {UTILIZATION} of {total / 2**30:.0f} GiB: KV cache {cache_bytes / 2**30:.1f} GiB, "
        f"device use {used / 2**30:.1f} GiB (bound {UTILIZATION * total / 2**30:.1f} GiB)"
    )
    assert 0 < cache_bytes <= UTILIZATION * total
    assert cache_bytes >= 0.5 * (UTILIZATION * total - used + cache_bytes)  # the cache got it
    assert used <= UTILIZATION * total + SLACK
