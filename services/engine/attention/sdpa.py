"""torch SDPA over a per-step gather of each request's own positions, as docs/architecture.md
prescribes for the CPU: no contiguous per-request cache, only the positions the step reads."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.engine.attention.base import AttentionBackend, store_kv
from services.engine.attention.metadata import AttentionMetadata, PrefillSeq


class TorchSDPABackend(AttentionBackend):
    """torch SDPA over a per-step gather of each request's own cached positions (CPU path, and the
    reference every other backend is checked against at start-up)."""

    name = "torch_sdpa"

    def forward(self, query, key, value, k_cache, v_cache, meta, scale):
        store_kv(key, value, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(query)
        for seq in meta.prefills:
            if seq.context_len > seq.query_len:  # fresh prompts go by group below
                rows = slice(seq.query_start, seq.query_start + seq.query_len)
                out[rows] = self._cached_prefill(query[rows], k_cache, v_cache, seq, scale)
        for rows, num_seqs in meta.fresh_prefill_groups:  # one batched causal SDPA call per length
            out[rows] = self._fresh_prefill(query[rows], key[rows], value[rows], num_seqs, scale)
        if meta.num_decodes:
            rows = slice(meta.num_prefill_tokens, None)
            out[rows] = self._decode(query[rows], k_cache, v_cache, meta, scale)
        return out

    def _fresh_prefill(self, q, k, v, num_seqs: int, scale: float) -> torch.Tensor:
        return _fresh_prefill_attention(q, k, v, num_seqs, scale)

    def _cached_prefill(self, q, k_cache, v_cache, seq: PrefillSeq, scale: float) -> torch.Tensor:
        return _prefill_attention(q, k_cache, v_cache, seq, scale)

    def _decode(self, q, k_cache, v_cache, meta, scale):
        return _decode_attention(q, k_cache, v_cache, meta, scale)


def _fresh_prefill_attention(q, k, v, num_seqs: int, scale: float) -> torch.Tensor:
    """`num_seqs` prompts of one length L with nothing cached: their new K/V are the whole
    context, so no gather. q: [num_seqs * L, num_heads, head_dim] -> the same shape."""
    q, k, v = (
        t.reshape(num_seqs, -1, *t.shape[1:]).transpose(1, 2) for t in (q, k, v)
    )  # [n, heads, L, D]
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    return out.transpose(1, 2).reshape(-1, *out.shape[1:2], out.shape[3])


def _prefill_attention(q, k_cache, v_cache, seq: PrefillSeq, scale: float) -> torch.Tensor:
    """A chunk after `context_len - query_len` cached positions (chunked prefill, recompute):
    q [query_len, num_heads, head_dim] -> the same shape."""
    q = q.transpose(0, 1).unsqueeze(0)  # [1, num_heads, query_len, head_dim]
    k, v = (gather(cache, seq.block_table, seq.context_len) for cache in (k_cache, v_cache))
    k, v = (t.transpose(0, 1).unsqueeze(0) for t in (k, v))  # [1, num_kv_heads, context_len, D]
    q_pos = torch.arange(seq.context_len - seq.query_len, seq.context_len, device=q.device)
    mask = torch.arange(seq.context_len, device=q.device)[None, :] <= q_pos[:, None]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def gather(cache: torch.Tensor, block_table: torch.Tensor, context_len: int) -> torch.Tensor:
    """The first `context_len` positions of one request: [context_len, num_kv_heads, head_dim]
    (a copy)."""
    num_kv_heads, head_dim = cache.shape[2:]
    return cache.index_select(0, block_table).view(-1, num_kv_heads, head_dim)[:context_len]


def _decode_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """One query token per request: q [num_decodes, num_heads, head_dim] -> the same shape.

    For each KV head, gathers every request's positions ([num_decodes, max_len, head_dim],
    contiguous, padded to the longest context) through the step's `decode_slots`, then runs that
    head's group of query heads as two batched matmuls with the softmax in float32. Padding needs
    no copy-and-zero pass: padded table entries repeat the request's own first block and
    unwritten slots were zeroed at allocation (`KVCache.allocate_slots`), so every masked
    position holds finite values that the -inf bias turns into exact zeros.
    """
    num_decodes = q.shape[0]
    num_kv_heads, head_dim = k_cache.shape[2:]
    slots = meta.decode_slots  # [num_decodes * max_len]
    k_rows = k_cache.view(-1, num_kv_heads, head_dim)  # [num_slots, num_kv_heads, head_dim]
    v_rows = v_cache.view(-1, num_kv_heads, head_dim)
    q = q.reshape(num_decodes, num_kv_heads, -1, head_dim)  # query heads grouped by their KV head
    out = torch.empty_like(q)
    for head in range(num_kv_heads):
        k = k_rows[:, head].index_select(0, slots).view(num_decodes, -1, head_dim)
        v = v_rows[:, head].index_select(0, slots).view(num_decodes, -1, head_dim)
        scores = torch.bmm(q[:, head], k.transpose(1, 2)).float()  # [num_decodes, group, max_len]
        probs = torch.softmax(scores.mul_(scale).add_(meta.decode_bias), dim=-1).to(q.dtype)
        out[:, head] = torch.bmm(probs, v)
    return out.view(num_decodes, -1, head_dim)
