"""torch FlexAttention over the paged cache, read in place.

The whole cache is one key sequence of num_blocks * block_size slots and the step's tokens one
query sequence; a mask says which slots each query may see: those in its own request's block
table, at logical positions up to its own. The mask reads a per-step map from (request, physical
block) to the block's logical index in that request (-1 where the request does not hold it),
so a block shared by several requests (prefix caching) serves each at its own position. This
is the physical-to-logical scheme of vLLM's FlexAttention backend.

On CUDA the kernel is compiled (`torch.compile`) and the block mask skips every tile no query
may see; on the CPU it runs eagerly (dense scores over the whole cache: for tests only).
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from services.engine.attention.base import AttentionBackend, store_kv
from services.engine.attention.metadata import AttentionMetadata


@functools.cache
def _compiled_flex_attention():
    return torch.compile(flex_attention, dynamic=True)


# The forward kernel's tiles on CUDA. Inductor's default for bf16 on sm_90 (128 x 128 tiles,
# 3 stages) asked for 368 KiB of shared memory with our GQA layout on an H200 (limit 227 KiB:
# "No valid triton configs ... out of resource"); 64 x 64 tiles in 2 stages fit every head
# size we serve. `fwd_` keeps them off the decoding kernel, which picks its own.
CUDA_KERNEL_OPTIONS = {
    "fwd_BLOCK_M": 64,
    "fwd_BLOCK_N": 64,
    "fwd_num_stages": 2,
    "fwd_num_warps": 4,
}


class FlexAttentionBackend(AttentionBackend):
    """FlexAttention (torch >= 2.5) with a paged mask; see the module docstring."""

    name = "flex"

    def __init__(self, device: str) -> None:
        self.compiled = device.startswith("cuda")
        # The step whose block mask is cached, and the mask: held with its metadata, since an
        # id() alone could be reused by the next step's metadata once this one is freed.
        self._mask: tuple[AttentionMetadata, object] | None = None

    def forward(self, query, key, value, k_cache, v_cache, meta, scale):
        store_kv(key, value, k_cache, v_cache, meta.slot_mapping)
        num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
        block_mask = self._block_mask(meta, query.shape[0], num_blocks * block_size)
        q = query.transpose(0, 1).unsqueeze(0)  # [1, num_heads, num_tokens, head_dim]
        k = k_cache.view(1, -1, num_kv_heads, head_dim).transpose(1, 2)  # [1, kv_heads, S, D]
        v = v_cache.view(1, -1, num_kv_heads, head_dim).transpose(1, 2)
        with warnings.catch_warnings():  # the eager CPU path warns that it is not compiled
            warnings.simplefilter("ignore", UserWarning)
            if self.compiled:
                out = _compiled_flex_attention()(
                    q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True,
                    kernel_options=CUDA_KERNEL_OPTIONS,
                )  # fmt: skip
            else:
                out = flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True)
        return out[0].transpose(0, 1)

    def _block_mask(self, meta: AttentionMetadata, num_tokens: int, num_slots: int):
        """One block mask per step (every layer shares it)."""
        if self._mask is None or self._mask[0] is not meta:
            self._mask = (meta, paged_block_mask(meta, num_tokens, num_slots))
        return self._mask[1]


def paged_block_mask(meta: AttentionMetadata, num_tokens: int, num_slots: int):
    """The FlexAttention BlockMask of one step: query token t (of request r, at position p) sees
    cache slot s iff block s // block_size is logical block j of r and j * block_size +
    s % block_size <= p."""
    layout, block_size = meta.varlen, meta.block_size
    device = layout.seq_lens.device
    query_lens = (layout.query_start_loc[1:] - layout.query_start_loc[:-1]).long()
    q_seq = torch.repeat_interleave(
        torch.arange(layout.num_seqs, device=device), query_lens, output_size=num_tokens
    )
    starts = layout.query_start_loc[:-1].long()[q_seq]  # [num_tokens]
    q_pos = (layout.seq_lens - query_lens)[q_seq] + torch.arange(num_tokens, device=device) - starts
    num_blocks = num_slots // block_size
    # Only each request's own blocks: padded table entries (which repeat its first block) go
    # to a spare column past the last block, dropped after the scatter.
    width = layout.block_table.shape[1]
    logical = torch.arange(width, device=device).expand(layout.num_seqs, width)
    used = (layout.seq_lens.long() + block_size - 1) // block_size
    index = torch.where(logical < used[:, None], layout.block_table.long(), num_blocks)
    physical_to_logical = torch.full(
        (layout.num_seqs, num_blocks + 1), -1, dtype=torch.long, device=device
    ).scatter_(1, index, logical)[:, :num_blocks]

    def mask_mod(b, h, q_idx, kv_idx):
        block = physical_to_logical[q_seq[q_idx], kv_idx // block_size]
        return (block >= 0) & (block * block_size + kv_idx % block_size <= q_pos[q_idx])

    return create_block_mask(
        mask_mod, None, None, num_tokens, num_slots, device=str(device), BLOCK_SIZE=128
    )
