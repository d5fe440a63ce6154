"""What every layer's attention needs for one step: the flattened batch and its paged layout.

The model runner builds one `AttentionMetadata` per step; backends read the form they need:
per-request prefill block tables and a padded decode batch (the torch paths), or one varlen
layout for the whole step (`VarlenLayout`: the kernels' form, as vLLM's and flash-attn's varlen
APIs take it).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class PrefillSeq:
    """One request computing `query_len` > 1 tokens (or a first chunk) this step."""

    query_start: int  # offset of its first query token in the flattened batch
    query_len: int  # tokens computed this step
    context_len: int  # tokens with KV after this step (cached + new)
    block_table: torch.Tensor  # [num_blocks] long, blocks covering [0, context_len)


@dataclass(frozen=True)
class VarlenLayout:
    """Every request of the step in token order (prefills, then decodes), as varlen kernels take
    it. Built on the step's device without a host sync.

    query_start_loc: [num_seqs + 1] int32, offsets of each request's query tokens (cu_seqlens_q).
    seq_lens: [num_seqs] int32, tokens with KV after this step (cached + new), per request.
    block_table: [num_seqs, max_blocks] int32, padded with each row's first block.
    max_query_len: longest query of the step, in tokens.
    max_seq_len: an upper bound of `seq_lens` in tokens (max_blocks * block_size).
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    max_query_len: int
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])


@dataclass(frozen=True)
class AttentionMetadata:
    """Inputs every layer's attention needs for one step.

    Tokens are flattened as [prefill tokens..., decode tokens...]; decode requests (one query
    token each) come last so they run as one padded batch. A slot_mapping entry < 0 marks a
    padding token whose K/V is not stored (CUDA-graph batches are padded to a captured size).
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
    def varlen(self) -> VarlenLayout:
        """The whole step as one varlen layout (computed once per step, shared by every layer)."""
        device = self.slot_mapping.device
        width = max(
            [int(self.decode_block_tables.shape[1])]
            + [int(s.block_table.shape[0]) for s in self.prefills]
        )
        rows = [
            torch.cat([s.block_table, s.block_table[:1].expand(width - s.block_table.shape[0])])
            for s in self.prefills
        ]
        decode_rows = self.decode_block_tables
        if not self.num_decodes:
            decode_rows = decode_rows.new_empty(0, width)
        elif decode_rows.shape[1] < width:
            decode_rows = torch.cat(
                [decode_rows, decode_rows[:, :1].expand(-1, width - decode_rows.shape[1])], dim=1
            )
        block_table = torch.cat([*(r[None] for r in rows), decode_rows])
        query_lens = [s.query_len for s in self.prefills] + [1] * self.num_decodes
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        prefill_lens = torch.tensor(
            [s.context_len for s in self.prefills], dtype=torch.int32, device=device
        )
        return VarlenLayout(
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.cat([prefill_lens, self.decode_context_lens.to(torch.int32)]),
            block_table=block_table.to(device=device, dtype=torch.int32),
            max_query_len=max(query_lens, default=0),
            max_seq_len=width * self.block_size,
        )

    @cached_property
    def fresh_prefill_groups(self) -> tuple[tuple[torch.Tensor | slice, int], ...]:
        """Prompts with nothing cached before them, grouped by length: (their token rows, num_seqs)
        per length (computed once per step, shared by every layer). The rows are a slice where
        the group's prompts sit back to back in the batch (one prompt always does), so a layer
        takes views of q, k, v and writes its output in place; else [num_seqs * length] long
        indices (a gather and a scatter per layer: 4% of a 256-token prefill)."""
        by_length: dict[int, list[PrefillSeq]] = {}
        for seq in self.prefills:
            if seq.context_len == seq.query_len:
                by_length.setdefault(seq.query_len, []).append(seq)
        return tuple((self._rows(seqs), len(seqs)) for seqs in by_length.values())

    def _rows(self, seqs: list[PrefillSeq]) -> torch.Tensor | slice:
        start, end = seqs[0].query_start, seqs[-1].query_start + seqs[-1].query_len
        if end - start == sum(s.query_len for s in seqs):  # in order and back to back
            return slice(start, end)
        device = self.slot_mapping.device
        return torch.cat(
            [torch.arange(s.query_start, s.query_start + s.query_len, device=device) for s in seqs]
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
