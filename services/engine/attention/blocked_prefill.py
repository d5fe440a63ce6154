"""Causal prefill attention as blocks of batched matmuls (oneDNN), for CPUs where torch's fused
CPU flash attention is slow.

torch's CPU flash-attention kernel (`_scaled_dot_product_flash_attention_for_cpu`) runs its
query-key and probability-value products in float32 through the BLAS torch was built with
(MKL), except on CPUs with AMX, where it packs bfloat16 tiles. On an AMD EPYC (AVX-512 BF16, no
AMX) MKL runs its generic kernel (`mkl_blas_def_sgemm_kernel_0_zen` in `perf`), and a 2,048-token
bfloat16 prompt of SmolLM2-135M spent 65% of its prefill there, 43.6 ms a layer (torch.profiler,
docs/benchmarks.md, "A ninth sitting"). torch's `bmm` on bfloat16 goes to oneDNN instead, which
uses the CPU's bfloat16 dot products.

So here a chunk of queries is cut into blocks of rows; each block multiplies its queries with
the keys it can see (the causal mask applies only to the block's diagonal part), takes the
softmax in float32 and multiplies the probabilities with the values, every product one batched
bfloat16 matmul over the KV heads (query heads grouped by their KV head, no repeated K/V). The
scores are rounded to the model's dtype before the softmax, as transformers' eager attention
rounds them; the block bounds the float32 buffer to a few MB. This is the textbook blocked
form (FlashAttention's tiling over query rows, without its online softmax: each block sees
all its keys at once).
"""

from __future__ import annotations

import torch

from services.engine.kernels import load_cpu_kernels

BLOCK_ROWS = 256
"""Query rows per block: its float32 scores (rows x heads x keys) stay a few MB at 2,048 keys."""


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention of the last `q.shape[0]` positions of a sequence over all of it.

    q: [num_queries, num_heads, head_dim]; k, v: [num_keys, num_kv_heads, head_dim] with
    num_keys >= num_queries (query i sits at position num_keys - num_queries + i and sees keys
    0 .. that position). num_heads must be a multiple of num_kv_heads (grouped-query attention).
    Returns [num_queries, num_heads, head_dim] in q's dtype. Raises ValueError for a shape that
    breaks these rules.
    """
    num_queries, num_heads, head_dim = q.shape
    num_keys, num_kv_heads = k.shape[:2]
    if num_keys < num_queries or num_heads % num_kv_heads or v.shape != k.shape:
        raise ValueError(
            f"causal_attention: q {tuple(q.shape)} against k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    kernels = load_cpu_kernels() if q.device.type == "cpu" else None
    group = num_heads // num_kv_heads
    offset = num_keys - num_queries
    # [kv_heads, queries * group, head_dim]: row r * group + j is query r's j-th head of the group
    qg = q.reshape(num_queries, num_kv_heads, group, head_dim).transpose(0, 1)
    qg = qg.reshape(num_kv_heads, num_queries * group, head_dim)
    kc = k.transpose(0, 1).contiguous()  # [kv_heads, keys, head_dim]
    vc = v.transpose(0, 1).contiguous()
    out = torch.empty(num_kv_heads, num_queries, group, head_dim, dtype=q.dtype, device=q.device)
    for start in range(0, num_queries, BLOCK_ROWS):
        end = min(start + BLOCK_ROWS, num_queries)
        rows, seen = end - start, offset + end  # the block's queries see keys [0, seen)
        scores = torch.bmm(qg[:, start * group : end * group], kc[:, :seen].transpose(1, 2))
        scores = scores.view(num_kv_heads, rows, group, seen)
        if kernels is not None:  # in place: scale, mask, float32 softmax, rounded once
            kernels.causal_softmax(scores, scale, offset + start)
            probs = scores
        else:
            scores = scores.float().mul_(scale)
            diagonal = scores[..., offset + start :]  # [kv_heads, rows, group, rows]
            future = torch.ones(rows, rows, dtype=torch.bool, device=q.device).triu_(1)
            diagonal.masked_fill_(future[None, :, None, :], float("-inf"))
            probs = torch.softmax(scores, dim=-1).to(q.dtype)
        probs = probs.view(num_kv_heads, rows * group, seen)
        out[:, start:end] = torch.bmm(probs, vc[:, :seen]).view(num_kv_heads, rows, group, -1)
    return out.transpose(0, 1).reshape(num_queries, num_heads, head_dim)
