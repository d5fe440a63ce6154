"""The attention backend interface: one layer of one step over the paged KV cache."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from services.engine.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    """Computes attention for one layer of one step, reading and writing the paged cache."""

    name: str = ""  # its registry name (`--attention-backend`)
    # Launches no host sync and takes fixed-shape inputs given a seeded `meta.varlen` and
    # slot_mapping entries of -1 for padding, so a CUDA graph can capture it (cuda_graphs.py).
    cuda_graph_safe: bool = False

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Write `key`/`value` into the cache at `meta.slot_mapping`, then attend.

        query: [num_tokens, num_heads, head_dim]; key, value: [num_tokens, num_kv_heads, head_dim];
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim].
        Returns [num_tokens, num_heads, head_dim]. Causal: query at position p sees keys 0..p.
        """


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write the step's new K/V ([num_tokens, num_kv_heads, head_dim]) into their flat slots
    (`slot_mapping`, [num_tokens] long); the torch backends' cache write."""
    num_kv_heads, head_dim = k_cache.shape[2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)
