"""Llama-family forward pass (llama, qwen2, mistral) over the paged KV cache.

The weights, norms, MLPs and rotary embedding are transformers' own modules, so the numerics match
the Hugging Face reference; only attention is ours (it reads and writes `KVCache`, never
transformers' DynamicCache). This follows how vLLM's model files reuse the checkpoint layout while
owning attention.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from services.engine.attention import AttentionBackend, AttentionMetadata
from services.engine.kv_cache import KVCache, KVCacheSpec

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")


class PagedLlamaForCausalLM(nn.Module):
    """Wraps a transformers `*ForCausalLM` of the Llama family; forward takes a flattened batch."""

    def __init__(self, hf_model: nn.Module, attention: AttentionBackend) -> None:
        super().__init__()
        config = hf_model.config
        self.config = config
        inner = hf_model.model
        self.embed_tokens = inner.embed_tokens
        self.layers = inner.layers
        self.norm = inner.norm
        self.rotary_emb = inner.rotary_emb
        self.lm_head = hf_model.lm_head
        self.attention = attention
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads

    def kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        return KVCacheSpec(len(self.layers), self.num_kv_heads, self.head_dim, block_size, dtype)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """input_ids, positions: [num_tokens] long; logits_indices: [num_logits] long.

        Returns float32 logits [num_logits, vocab_size] for the selected token rows only (a long
        prompt never materialises [num_tokens, vocab_size]).
        """
        hidden = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        cos, sin = self.rotary_emb(hidden.unsqueeze(0), positions.unsqueeze(0))  # [1, T, head_dim]
        for layer_idx, layer in enumerate(self.layers):
            residual = hidden
            hidden = layer.input_layernorm(hidden)
            hidden = self._attention(layer.self_attn, hidden, cos, sin, kv_cache, layer_idx, meta)
            hidden = residual + hidden
            residual = hidden
            hidden = residual + layer.mlp(layer.post_attention_layernorm(hidden))
        hidden = self.norm(hidden.index_select(0, logits_indices))
        return self.lm_head(hidden).float()

    def _attention(self, attn, hidden, cos, sin, kv_cache, layer_idx, meta) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        # [1, heads, T, head_dim], the layout apply_rotary_pos_emb expects.
        q = attn.q_proj(hidden).view(num_tokens, self.num_heads, self.head_dim).transpose(0, 1)[None]
        k = attn.k_proj(hidden).view(num_tokens, self.num_kv_heads, self.head_dim).transpose(0, 1)[None]
        v = attn.v_proj(hidden).view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        q, k = q[0].transpose(0, 1), k[0].transpose(0, 1)  # [T, heads, head_dim]
        k_cache, v_cache = kv_cache.layer(layer_idx)
        out = self.attention.forward(
            q.contiguous(), k.contiguous(), v.contiguous(), k_cache, v_cache, meta, attn.scaling
        )
        return attn.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))
