"""Attention over the paged KV cache.

`AttentionMetadata` describes one step's flattened batch; an `AttentionBackend` writes the step's
new K/V into their slots and computes attention for every query token. The CPU backend
(`TorchSDPABackend`) gathers exactly each request's own positions through its block table and
calls torch SDPA, as ARCHITECTURE.md prescribes; a CUDA backend (flash-attn paged kernels) can be
registered under another name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PrefillSeq:
    """One request computing `query_len` > 1 tokens (or a first chunk) this step."""

    query_start: int  # offset of its first query token in the flattened batch
    query_len: int  # tokens computed this step
    context_len: int  # tokens with KV after this step (cached + new)
    block_table: torch.Tensor  # [num_blocks] long, blocks covering [0, context_len)


@dataclass(frozen=True)
class AttentionMetadata:
    """Inputs every layer's attention needs for one step.

    Tokens are flattened as [prefill tokens..., decode tokens...]; decode requests (one query
    token each) come last so they run as one padded batch.
    """

    slot_mapping: torch.Tensor  # [num_tokens] long: flat cache slot of each new token
    prefills: tuple[PrefillSeq, ...]
    num_prefill_tokens: int
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] long, padded with 0
    decode_context_lens: torch.Tensor  # [num_decodes] long, including the new token

    @property
    def num_decodes(self) -> int:
        return int(self.decode_context_lens.shape[0])


class AttentionBackend(ABC):
    """Computes attention for one layer of one step, reading and writing the paged cache."""

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


class TorchSDPABackend(AttentionBackend):
    """torch SDPA over a per-step gather of each request's own cached positions (CPU path)."""

    def forward(self, query, key, value, k_cache, v_cache, meta, scale):
        block_size, num_kv_heads, head_dim = k_cache.shape[1:]
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, key)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, value)
        out = torch.empty_like(query)
        for seq in meta.prefills:
            rows = slice(seq.query_start, seq.query_start + seq.query_len)
            out[rows] = _prefill_attention(query[rows], key[rows], value[rows], k_cache, v_cache, seq, scale)
        if meta.num_decodes:
            rows = slice(meta.num_prefill_tokens, None)
            out[rows] = _decode_attention(query[rows], k_cache, v_cache, meta, scale)
        return out


def _prefill_attention(q, k, v, k_cache, v_cache, seq: PrefillSeq, scale: float) -> torch.Tensor:
    """q: [query_len, num_heads, head_dim] -> [query_len, num_heads, head_dim]."""
    q = q.transpose(0, 1).unsqueeze(0)  # [1, num_heads, query_len, head_dim]
    if seq.context_len == seq.query_len:
        # Nothing cached before this chunk: the new K/V are the whole context, no gather needed.
        k, v = (t.transpose(0, 1).unsqueeze(0) for t in (k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        return out[0].transpose(0, 1)
    k, v = (_gather(cache, seq.block_table, seq.context_len) for cache in (k_cache, v_cache))
    q_pos = torch.arange(seq.context_len - seq.query_len, seq.context_len, device=q.device)
    mask = torch.arange(seq.context_len, device=q.device)[None, :] <= q_pos[:, None]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def _gather(cache: torch.Tensor, block_table: torch.Tensor, context_len: int) -> torch.Tensor:
    """The first `context_len` positions of one request: [1, num_kv_heads, context_len, head_dim]."""
    num_kv_heads, head_dim = cache.shape[2:]
    rows = cache.index_select(0, block_table).view(-1, num_kv_heads, head_dim)[:context_len]
    return rows.transpose(0, 1).unsqueeze(0)


def _decode_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """One query token per request, padded to the longest context: q [num_decodes, num_heads, head_dim]."""
    num_decodes, max_blocks = meta.decode_block_tables.shape
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    max_len = max_blocks * block_size
    valid = torch.arange(max_len, device=q.device)[None, :] < meta.decode_context_lens[:, None]
    flat_tables = meta.decode_block_tables.reshape(-1)

    def gather(cache: torch.Tensor) -> torch.Tensor:
        rows = cache.index_select(0, flat_tables).view(num_decodes, max_len, num_kv_heads, head_dim)
        # Padding positions point at block 0, which belongs to someone else (or holds garbage):
        # zero them so no foreign value (NaN included) can leak through a masked score.
        rows = rows.masked_fill(~valid[:, :, None, None], 0.0)
        return rows.transpose(1, 2)  # [num_decodes, num_kv_heads, max_len, head_dim]

    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), gather(k_cache), gather(v_cache),
        attn_mask=valid[:, None, None, :], scale=scale, enable_gqa=True,
    )  # [num_decodes, num_heads, 1, head_dim]
    return out.squeeze(2)


_BACKENDS: dict[str, type[AttentionBackend]] = {"torch_sdpa": TorchSDPABackend}


def get_attention_backend(name: str = "torch_sdpa") -> AttentionBackend:
    """Registry lookup; raises ValueError naming `attention_backend` for an unknown name."""
    if name not in _BACKENDS:
        raise ValueError(f"attention_backend: unknown {name!r}, expected one of {sorted(_BACKENDS)}")
    return _BACKENDS[name]()
