"""Llama-family forward pass (llama, qwen2, mistral) over the paged KV cache.

The weights, norms, activation and rotary embedding are transformers' own, so the numerics match
the Hugging Face reference (on the CPU the elementwise ops between the matmuls run fused, rounding
where transformers does: `layer_ops`); attention is ours (it reads and writes `KVCache`, never
transformers' DynamicCache). As in vLLM's model files (QKVParallelLinear,
MergedColumnParallelLinear), q/k/v and gate/up are fused into one matmul each at load time: a
decode step is a few small matmuls per layer, and every matmul call saved is overhead saved.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, cast

import torch
from torch import nn

from services.engine.attention import AttentionBackend, AttentionMetadata
from services.engine.kv_cache import KVCache, KVCacheSpec
from services.engine.models.layer_ops import LayerOps
from services.engine.models.packed_linear import pack_linear

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")


def fuse_linear(*linears: nn.Linear) -> nn.Linear:
    """One Linear whose output is the concatenation of `linears`' outputs (same input)."""
    weight = torch.cat([linear.weight.detach() for linear in linears])
    has_bias = [linear.bias is not None for linear in linears]
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=any(has_bias), device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if any(has_bias):
        biases = [
            linear.bias.detach()
            if linear.bias is not None
            else weight.new_zeros(linear.out_features)
            for linear in linears
        ]
        fused.bias = nn.Parameter(torch.cat(biases), requires_grad=False)
    return fused


class FusedDecoderLayer(nn.Module):
    """One transformers decoder layer's weights: q/k/v and gate/up fused, every matmul packed for
    oneDNN where the device allows (`packed_linear`)."""

    def __init__(self, layer: Any) -> None:
        """`layer`: a transformers decoder layer of the family (duck-typed: each model type has
        its own class)."""
        super().__init__()
        attn, mlp = layer.self_attn, layer.mlp
        self.input_layernorm = layer.input_layernorm
        self.post_attention_layernorm = layer.post_attention_layernorm
        self.qkv_proj = pack_linear(fuse_linear(attn.q_proj, attn.k_proj, attn.v_proj))
        self.o_proj = pack_linear(attn.o_proj)
        self.gate_up_proj = pack_linear(fuse_linear(mlp.gate_proj, mlp.up_proj))
        self.down_proj = pack_linear(mlp.down_proj)
        self.act_fn = mlp.act_fn
        self.scaling = attn.scaling


class PagedLlamaForCausalLM(nn.Module):
    """Built from a transformers `*ForCausalLM` of the Llama family; forward takes a flattened
    batch."""

    def __init__(self, hf_model: Any, attention: AttentionBackend) -> None:
        """`hf_model`: the transformers model (duck-typed like `FusedDecoderLayer`'s `layer`)."""
        super().__init__()
        config = hf_model.config
        self.config = config
        inner = hf_model.model
        self.embed_tokens = inner.embed_tokens
        self.layers = nn.ModuleList(FusedDecoderLayer(layer) for layer in inner.layers)
        self.norm = inner.norm
        self.rotary_emb = inner.rotary_emb
        self.lm_head = pack_linear(
            hf_model.lm_head
        )  # a packed copy: embed_tokens keeps the tied weight
        self.attention = attention
        self.ops = LayerOps.for_model(hf_model, next(hf_model.parameters()).device)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.qk_v_sizes = [
            (self.num_heads + self.num_kv_heads) * self.head_dim,
            self.num_kv_heads * self.head_dim,
        ]
        # called on the stepping thread between two decoder layers of every forward (core
        # lending gives borrowed CPUs back there: `Engine.between_layers`)
        self.between_layers: Callable[[], None] | None = None

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
        cos, sin = cos[0].contiguous(), sin[0].contiguous()  # [T, head_dim]
        ops = self.ops
        # The residual stream is carried beside the layer's output and added in each norm
        # (vLLM's fused_add_rms_norm): residual + hidden, then the norm of that sum.
        residual = hidden
        between = self.between_layers
        for layer_idx, layer in enumerate(cast("Iterable[FusedDecoderLayer]", self.layers)):
            if layer_idx == 0:
                hidden = ops.rms_norm(hidden, layer.input_layernorm)
            else:
                if between is not None:
                    between()
                hidden, residual = ops.add_rms_norm(hidden, residual, layer.input_layernorm)
            hidden = self._attention(layer, hidden, cos, sin, kv_cache, layer_idx, meta)
            hidden, residual = ops.add_rms_norm(hidden, residual, layer.post_attention_layernorm)
            hidden = layer.down_proj(ops.silu_and_mul(layer.gate_up_proj(hidden), layer.act_fn))
        rows = hidden.index_select(0, logits_indices) + residual.index_select(0, logits_indices)
        return self.lm_head(ops.rms_norm(rows, self.norm)).float()

    def _attention(self, layer, hidden, cos, sin, kv_cache, layer_idx, meta) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qk, v = layer.qkv_proj(hidden).split(self.qk_v_sizes, dim=-1)
        # Rotary on q and k in one pass (transformers' formula, so the same numbers), in the
        # [T, heads, head_dim] layout: cos, sin [T, head_dim] apply to every head.
        qk = qk.view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        qk = self.ops.rotary(qk, cos, sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache.layer(layer_idx)
        out = self.attention.forward(q, k, v, k_cache, v_cache, meta, layer.scaling)
        return layer.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))
