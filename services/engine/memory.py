"""How many KV blocks an engine gets: a byte budget on the CPU, the device's leftover on CUDA.

On CUDA the engine follows vLLM's memory profiling: after the weights are loaded it runs one
forward of `max_num_batched_tokens` prompt tokens (the largest step the scheduler can build) on
a throwaway cache, reads the activation peak from the allocator, and gives the KV cache what
`gpu_memory_utilization` of the device leaves after everything already on it (this process's
weights and CUDA context, other processes) and that peak.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.engine.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from services.engine.kv_cache import KVCacheSpec

if TYPE_CHECKING:
    from services.engine.models import PagedLlamaForCausalLM


def kv_cache_budget(
    total_bytes: int, free_bytes: int, activation_peak_bytes: int, utilization: float
) -> int:
    """Bytes the KV cache may take: utilization * total, less what the device holds now
    (total - free) and the activation peak of the largest step. Raises ValueError naming
    `gpu_memory_utilization` when nothing is left."""
    budget = int(utilization * total_bytes) - (total_bytes - free_bytes) - activation_peak_bytes
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization: {utilization:g} of {total_bytes / 2**30:.1f} GiB leaves "
            f"no room for a KV cache ({(total_bytes - free_bytes) / 2**30:.1f} GiB in use, "
            f"{activation_peak_bytes / 2**30:.2f} GiB activation peak); raise it or lower "
            "--max-num-batched-tokens"
        )
    return budget


def num_kv_blocks(config: EngineConfig, spec: KVCacheSpec, model: PagedLlamaForCausalLM) -> int:
    """`num_blocks`, else the blocks `kv_cache_memory_bytes` holds, else (CUDA) the blocks the
    profiled budget holds, else (CPU) the blocks of 1 GiB. Raises ValueError naming the field
    when not even one block fits."""
    if config.num_blocks is not None:
        return config.num_blocks
    if config.kv_cache_memory_bytes is not None:
        return spec.num_blocks_for(config.kv_cache_memory_bytes)
    if not config.device.startswith("cuda"):
        return spec.num_blocks_for(DEFAULT_CPU_KV_CACHE_BYTES)
    return spec.num_blocks_for(_profiled_cuda_budget(config, spec, model))


def _profiled_cuda_budget(
    config: EngineConfig, spec: KVCacheSpec, model: PagedLlamaForCausalLM
) -> int:
    import torch

    from services.engine.attention import AttentionMetadata, PrefillSeq
    from services.engine.kv_cache import KVCache

    device = torch.device(config.device)
    num_tokens = min(config.max_num_batched_tokens, config.max_model_len or 2048)
    num_blocks = -(-num_tokens // spec.block_size)
    cache = KVCache(spec, num_blocks, config.device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    table = torch.arange(num_blocks, device=device)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(num_tokens, device=device),
        prefills=(PrefillSeq(0, num_tokens, num_tokens, table),),
        num_prefill_tokens=num_tokens,
        decode_block_tables=torch.empty(0, 0, dtype=torch.long, device=device),
        decode_context_lens=torch.empty(0, dtype=torch.long, device=device),
        block_size=spec.block_size,
    )
    ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    positions = torch.arange(num_tokens, device=device)
    model(ids, positions, cache, meta, torch.tensor([num_tokens - 1], device=device))
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del cache
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return kv_cache_budget(total, free, peak, config.gpu_memory_utilization)
