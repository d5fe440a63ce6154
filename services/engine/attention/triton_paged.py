"""Paged attention in Triton: one kernel for prefill chunks and decode, reading K/V in place
through the block table.

The algorithm is FlashAttention-2's (Dao, 2023: online softmax over key tiles, the output
rescaled as the running maximum grows) over vLLM's paged layout (Kwon et al., 2023), with the
whole step in one launch as vLLM's unified Triton attention does: a program takes one request,
one KV head and a tile of that request's query tokens, and packs the KV head's query heads
(GQA) into the rows of its tile, so each K/V tile it loads serves them all. Keys past a query's
position and past the request's context are masked; a query never reads a slot outside its own
block table.

Runs on CUDA, and on the CPU in Triton's interpreter (`TRITON_INTERPRET=1`), which the CPU test
suite uses to check it against torch SDPA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.engine.attention.base import AttentionBackend
from services.engine.attention.metadata import AttentionMetadata
from services.env import triton_interpret

BLOCK_N = 32  # key positions per tile, independent of block_size (positions map to pages)
MIN_ROWS = 16  # tl.dot needs tiles of at least 16 rows on the GPU


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cache_slot,
    stride_cache_head,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:  # < 0: a padding token (CUDA-graph batches), nothing to store
        d = tl.arange(0, HEAD_DIM_P)
        ok = d < HEAD_DIM
        dst = slot * stride_cache_slot + head * stride_cache_head + d
        k = tl.load(key_ptr + token * stride_kt + head * stride_kh + d, mask=ok)
        v = tl.load(value_ptr + token * stride_vt + head * stride_vh + d, mask=ok)
        tl.store(k_cache_ptr + dst, k, mask=ok)
        tl.store(v_cache_ptr + dst, v, mask=ok)


@triton.jit
def _paged_attention_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_table,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_P: tl.constexpr,  # GROUP rounded up to a power of two
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    PRECISION: tl.constexpr,  # tl.dot input precision: "ieee" for float32 (no TF32 rounding)
    DOT_FP32: tl.constexpr,  # upcast tl.dot operands to float32 (the interpreter: see below)
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_tile = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        rows = tl.arange(0, BLOCK_Q * GROUP_P)
        token = q_tile * BLOCK_Q + rows // GROUP_P
        head = kv_head * GROUP + rows % GROUP_P
        row_ok = (token < q_len) & (rows % GROUP_P < GROUP)
        d = tl.arange(0, HEAD_DIM_P)
        d_ok = d < HEAD_DIM
        q_offs = (q_start + token)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
        q = tl.load(q_ptr + q_offs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        if DOT_FP32:
            q = q.to(tl.float32)
        q_pos = seq_len - q_len + token  # [rows]: each query's position in its request
        m_i = tl.full([BLOCK_Q * GROUP_P], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_Q * GROUP_P], tl.float32)
        acc = tl.zeros([BLOCK_Q * GROUP_P, HEAD_DIM_P], tl.float32)
        # Causal: the tile's last query sees keys up to its own position, no further.
        kv_end = tl.minimum(seq_len, seq_len - q_len + (q_tile + 1) * BLOCK_Q)
        for start in range(0, kv_end, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            pos_ok = pos < kv_end
            block = tl.load(
                block_table_ptr + seq * stride_table + pos // BLOCK_SIZE, mask=pos_ok, other=0
            ).to(tl.int64)
            kv_offs = (
                block * stride_cache_block
                + (pos % BLOCK_SIZE) * stride_cache_slot
                + kv_head * stride_cache_head
            )
            kv_mask = pos_ok[:, None] & d_ok[None, :]
            k = tl.load(k_cache_ptr + kv_offs[:, None] + d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_cache_ptr + kv_offs[:, None] + d[None, :], mask=kv_mask, other=0.0)
            if DOT_FP32:
                k, v = k.to(tl.float32), v.to(tl.float32)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            visible = pos_ok[None, :] & (pos[None, :] <= q_pos[:, None])
            scores = tl.where(visible, scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible
            p = tl.exp(scores - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_offs = (q_start + token)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(
            out_ptr + o_offs,
            acc.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )


def store_kv_triton(key, value, k_cache, v_cache, slot_mapping) -> None:
    """`base.store_kv` as a kernel that skips slots < 0 (padding tokens), so a CUDA graph can
    replay it on a padded batch. key, value: [num_tokens, num_kv_heads, head_dim]."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens, num_kv_heads)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(1),
        k_cache.stride(2),
        HEAD_DIM=head_dim,
        HEAD_DIM_P=triton.next_power_of_2(head_dim),
    )


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    max_query_len: int | None = None,
) -> torch.Tensor:
    """Causal attention of every query token over its request's cached positions.

    query: [num_tokens, num_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size,
    num_kv_heads, head_dim] (the step's K/V already stored). `max_query_len` bounds the query
    tiles launched (default the step's own; a CUDA graph passes the captured one).
    Returns [num_tokens, num_heads, head_dim] in the query's dtype.
    """
    layout = meta.varlen
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    group_p = triton.next_power_of_2(group)
    max_q = max_query_len if max_query_len is not None else layout.max_query_len
    block_q = max(MIN_ROWS // group_p, 1) if max_q == 1 else max(64 // group_p, 1)
    # Triton's CPU interpreter computes tl.dot on bfloat16 operands wrongly (numpy has no
    # bfloat16: the bits are multiplied as integers), so under it the operands are upcast.
    dot_fp32 = triton_interpret() and query.dtype != torch.float32
    out = torch.empty_like(query)
    if layout.num_seqs == 0:
        return out
    grid = (layout.num_seqs, num_kv_heads, triton.cdiv(max_q, block_q))
    _paged_attention_kernel[grid](
        out,
        query,
        k_cache,
        v_cache,
        layout.block_table,
        layout.query_start_loc,
        layout.seq_lens,
        scale,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        layout.block_table.stride(0),
        GROUP=group,
        GROUP_P=group_p,
        BLOCK_Q=block_q,
        BLOCK_N=BLOCK_N,
        BLOCK_SIZE=meta.block_size,
        HEAD_DIM=head_dim,
        HEAD_DIM_P=triton.next_power_of_2(head_dim),
        PRECISION="ieee" if query.dtype == torch.float32 or dot_fp32 else "tf32",
        DOT_FP32=dot_fp32,
    )
    return out


class TritonPagedBackend(AttentionBackend):
    """The Triton kernels above for the cache write and all of a step's attention (CUDA; the
    CPU only under `TRITON_INTERPRET=1`)."""

    name = "triton"
    cuda_graph_safe = True

    def forward(self, query, key, value, k_cache, v_cache, meta, scale):
        store_kv_triton(key, value, k_cache, v_cache, meta.slot_mapping)
        return paged_attention(query, k_cache, v_cache, meta, scale)
