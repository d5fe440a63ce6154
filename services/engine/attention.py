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
from functools import cached_property

import torch
import torch.nn.functional as F

from services.engine.config import ATTENTION_BACKENDS


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
    decode_block_tables: (
        torch.Tensor
    )  # [num_decodes, max_blocks] long, padded with each row's first block
    decode_context_lens: torch.Tensor  # [num_decodes] long, including the new token
    block_size: int  # tokens per KV block

    @property
    def num_decodes(self) -> int:
        return int(self.decode_context_lens.shape[0])

    @cached_property
    def fresh_prefill_groups(self) -> tuple[tuple[torch.Tensor, int], ...]:
        """Prompts with nothing cached before them, grouped by length: (their token rows
        [num_seqs * length] long, num_seqs) per length (computed once per step, shared by every
        layer)."""
        by_length: dict[int, list[PrefillSeq]] = {}
        for seq in self.prefills:
            if seq.context_len == seq.query_len:
                by_length.setdefault(seq.query_len, []).append(seq)
        device = self.slot_mapping.device
        return tuple(
            (
                torch.cat(
                    [
                        torch.arange(s.query_start, s.query_start + s.query_len, device=device)
                        for s in seqs
                    ]
                ),
                len(seqs),
            )
            for seqs in by_length.values()
        )

    @cached_property
    def decode_slots(self) -> torch.Tensor:
        """[num_decodes * max_blocks * block_size] long: the cache slot of every (request,
        position) pair of the padded decode batch (computed once per step)."""
        offsets = torch.arange(self.block_size, device=self.decode_block_tables.device)
        return (self.decode_block_tables[:, :, None] * self.block_size + offsets).reshape(-1)

    @cached_property
    def decode_bias(self) -> torch.Tensor:
        """[num_decodes, 1, max_blocks * block_size] float32: 0 at a request's positions, -inf past
        its context (computed once per step, shared by every layer)."""
        num_decodes, max_blocks = self.decode_block_tables.shape
        max_len = max_blocks * self.block_size
        positions = torch.arange(max_len, device=self.decode_context_lens.device)
        bias = torch.zeros(num_decodes, 1, max_len, device=positions.device)
        return bias.masked_fill_(
            (positions[None, :] >= self.decode_context_lens[:, None])[:, None, :], float("-inf")
        )


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
            if seq.context_len > seq.query_len:  # fresh prompts go by group below
                rows = slice(seq.query_start, seq.query_start + seq.query_len)
                out[rows] = _prefill_attention(query[rows], k_cache, v_cache, seq, scale)
        for rows, num_seqs in meta.fresh_prefill_groups:  # one batched causal SDPA call per length
            out[rows] = _fresh_prefill_attention(
                query[rows], key[rows], value[rows], num_seqs, scale
            )
        if meta.num_decodes:
            rows = slice(meta.num_prefill_tokens, None)
            out[rows] = self._decode(query[rows], k_cache, v_cache, meta, scale)
        return out

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
    k, v = (_gather(cache, seq.block_table, seq.context_len) for cache in (k_cache, v_cache))
    q_pos = torch.arange(seq.context_len - seq.query_len, seq.context_len, device=q.device)
    mask = torch.arange(seq.context_len, device=q.device)[None, :] <= q_pos[:, None]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def _gather(cache: torch.Tensor, block_table: torch.Tensor, context_len: int) -> torch.Tensor:
    """The first `context_len` positions of one request:
    [1, num_kv_heads, context_len, head_dim]."""
    num_kv_heads, head_dim = cache.shape[2:]
    rows = cache.index_select(0, block_table).view(-1, num_kv_heads, head_dim)[:context_len]
    return rows.transpose(0, 1).unsqueeze(0)


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


class CPUPagedBackend(TorchSDPABackend):
    """Decode through pdserve's C++ paged-attention kernel (`services/engine/kernels`), which
    reads each request's K/V in place through its block table instead of gathering a copy per
    layer; prefill chunks go through torch SDPA as in `TorchSDPABackend`."""

    def __init__(self) -> None:
        from services.engine.kernels import load_paged_attention

        self.kernel = load_paged_attention()
        if self.kernel is None:
            raise ValueError(
                "attention_backend: 'cpu_paged' needs the C++ kernel, which could not be built here"
            )

    def _decode(self, q, k_cache, v_cache, meta, scale):
        q = q.contiguous()
        out = torch.empty_like(q)
        self.kernel.paged_decode_attention(
            out, q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale
        )
        return out


_BACKENDS: dict[str, type[AttentionBackend]] = {
    "torch_sdpa": TorchSDPABackend,
    "cpu_paged": CPUPagedBackend,
}
BACKEND_NAMES = ATTENTION_BACKENDS
assert set(BACKEND_NAMES) == {"auto", *_BACKENDS}, "config.ATTENTION_BACKENDS is out of date"


def get_attention_backend(name: str, device: str) -> AttentionBackend:
    """Registry lookup. "auto" picks `cpu_paged` on the CPU when its kernel builds, else
    `torch_sdpa`. Raises ValueError naming `attention_backend` for an unknown or unusable name."""
    if name == "auto":
        from services.engine.kernels import load_paged_attention

        name = (
            "cpu_paged" if device == "cpu" and load_paged_attention() is not None else "torch_sdpa"
        )
    if name not in _BACKENDS:
        raise ValueError(
            f"attention_backend: unknown {name!r}, expected one of {list(BACKEND_NAMES)}"
        )
    if name == "cpu_paged" and device != "cpu":
        raise ValueError(f"attention_backend: 'cpu_paged' runs on the CPU only, not {device!r}")
    return _BACKENDS[name]()
