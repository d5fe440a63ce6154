"""flash-attn 2's paged varlen kernel (`flash_attn_varlen_func` with a `block_table`).

UNVERIFIED: no machine of ours has flash-attn (the lent GPU has none, the CPU cannot build it),
so this backend has never run. What is checked, on the CPU, is the layout it is given
(`flash_layout`): the tests feed it to a torch model of the kernel's documented semantics and
compare with SDPA over the same cache. The start-up self-test would refuse a build that
disagrees with SDPA (a wrong build returning zeros is a known failure).

flash-attn's layout (its `flash_attn_varlen_func` / `flash_attn_with_kvcache` docstrings):
- k_cache, v_cache: [num_blocks, page_block_size, num_kv_heads, head_dim], ours (NHD) as is.
- page_block_size must be a multiple of 256: `--block-size 256` (the CPU default 16 is refused).
- block_table: [num_seqs, max_blocks] int32; cu_seqlens_q, cu_seqlens_k: [num_seqs + 1] int32
  (cu_seqlens_k over each request's whole context, cached + new).
- causal is aligned to the bottom right: query i of a request with q_len queries and k_len keys
  sees keys 0 .. k_len - q_len + i, which is exactly a chunk after its cached prefix.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from importlib import metadata

import torch

from services.engine.attention.base import AttentionBackend, store_kv
from services.engine.attention.metadata import AttentionMetadata

FLASH_BLOCK_MULTIPLE = 256


@dataclass(frozen=True)
class FlashLayout:
    """One step in flash-attn's varlen paged layout (all int32, on the step's device)."""

    cu_seqlens_q: torch.Tensor  # [num_seqs + 1]
    cu_seqlens_k: torch.Tensor  # [num_seqs + 1]
    max_seqlen_q: int  # tokens
    max_seqlen_k: int  # tokens (an upper bound: max_blocks * block_size)
    block_table: torch.Tensor  # [num_seqs, max_blocks]


def check_flash_block_size(block_size: int) -> None:
    """ValueError naming `block_size` unless flash-attn's paged kernels accept it."""
    if block_size % FLASH_BLOCK_MULTIPLE:
        raise ValueError(
            f"block_size: flash-attn's paged KV needs a multiple of {FLASH_BLOCK_MULTIPLE}, "
            f"got {block_size} (pass --block-size 256, or another --attention-backend)"
        )


def flash_layout(meta: AttentionMetadata) -> FlashLayout:
    """`meta` as flash_attn_varlen_func takes it (no host sync)."""
    layout = meta.varlen
    zero = layout.seq_lens.new_zeros(1)
    return FlashLayout(
        cu_seqlens_q=layout.query_start_loc,
        cu_seqlens_k=torch.cat([zero, torch.cumsum(layout.seq_lens, 0, dtype=torch.int32)]),
        max_seqlen_q=layout.max_query_len,
        max_seqlen_k=layout.max_seq_len,
        block_table=layout.block_table,
    )


@functools.cache
def flash_attn_version() -> str | None:
    """The installed flash-attn's version if it imports with the running torch, else None."""
    try:
        import flash_attn  # noqa: F401  (an ABI mismatch with torch fails here)
    except (ImportError, OSError, RuntimeError):
        return None
    return metadata.version("flash-attn")


class FlashAttnBackend(AttentionBackend):
    """flash-attn 2 over the paged cache, all of a step in one varlen call (unverified: see the
    module docstring). Raises ValueError naming `attention_backend` where flash-attn does not
    import, or `block_size` when it is not a multiple of 256."""

    name = "flash_attn"

    def __init__(self, block_size: int) -> None:
        if flash_attn_version() is None:
            raise ValueError(
                "attention_backend: 'flash_attn' needs flash-attn built for this torch "
                "(pip install 'pdserve[gpu]')"
            )
        check_flash_block_size(block_size)
        from flash_attn import flash_attn_varlen_func

        self._varlen = flash_attn_varlen_func

    def forward(self, query, key, value, k_cache, v_cache, meta, scale):
        store_kv(key, value, k_cache, v_cache, meta.slot_mapping)
        layout = flash_layout(meta)
        return self._varlen(
            query,
            k_cache,
            v_cache,
            cu_seqlens_q=layout.cu_seqlens_q,
            cu_seqlens_k=layout.cu_seqlens_k,
            max_seqlen_q=layout.max_seqlen_q,
            max_seqlen_k=layout.max_seqlen_k,
            softmax_scale=scale,
            causal=True,
            block_table=layout.block_table,
        )
