"""The elementwise ops between a Llama-family layer's matmuls: RMSNorm (with the residual add
folded in), SiLU-and-mul and the rotary embedding.

On the CPU they run as pdserve's fused C++ kernels (`services/engine/kernels/fused_ops.cpp`,
vLLM's CPU set: rms_norm, fused_add_rms_norm, silu_and_mul, rotary_embedding), one pass over the
activations each where the torch formulas take several; elsewhere, or where the kernels cannot be
built, they run as transformers' own modules and formulas. Both round to the model's dtype at the
same points, so the two paths agree to the order of a float32 sum (tests/engine/test_layer_ops.py).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch
from transformers.models.llama.modeling_llama import rotate_half


class LayerOps:
    """The fused path (`kernels` given) or the torch path (`kernels` None) of one model.

    Shapes: x, residual [num_tokens, hidden_size]; gate_up [num_tokens, 2 * intermediate_size];
    qk [num_tokens, num_heads + num_kv_heads, head_dim] (token rows may be strided); cos, sin
    [num_tokens, head_dim], in the model's dtype.
    """

    def __init__(self, kernels: ModuleType | None) -> None:
        self.kernels = kernels

    @classmethod
    def for_model(cls, hf_model: Any, device: torch.device) -> LayerOps:
        """The fused path where it applies: a float32 or bfloat16 CPU model whose activation is
        SiLU and whose norms are RMSNorms with a `variance_epsilon` (Llama, Qwen2, Mistral), and
        the kernels build."""
        norm = hf_model.model.norm
        fusable = (
            device.type == "cpu"
            and next(hf_model.parameters()).dtype in (torch.float32, torch.bfloat16)
            and getattr(hf_model.config, "hidden_act", None) == "silu"
            and type(norm).__name__.endswith("RMSNorm")
            and hasattr(norm, "variance_epsilon")
        )
        if not fusable:
            return cls(None)
        from services.engine.kernels import load_cpu_kernels

        return cls(load_cpu_kernels())

    @property
    def fused(self) -> bool:
        return self.kernels is not None

    def rms_norm(self, x: torch.Tensor, norm: Any) -> torch.Tensor:
        """norm(x), a new tensor."""
        if self.kernels is None:
            return norm(x)
        out = torch.empty_like(x)
        self.kernels.rms_norm(out, x, norm.weight, norm.variance_epsilon)
        return out

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, norm: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x). The fused path writes both in place (x and
        residual must be contiguous and not needed afterwards)."""
        if self.kernels is None:
            residual = residual + x
            return norm(residual), residual
        self.kernels.fused_add_rms_norm(x, residual, norm.weight, norm.variance_epsilon)
        return x, residual

    def silu_and_mul(self, gate_up: torch.Tensor, act_fn: Any) -> torch.Tensor:
        """act_fn(gate) * up of gate_up = [gate | up]: [num_tokens, intermediate_size]."""
        if self.kernels is None:
            gate, up = gate_up.chunk(2, dim=-1)
            return act_fn(gate) * up
        out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
        self.kernels.silu_and_mul(out, gate_up)
        return out

    def rotary(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """qk * cos + rotate_half(qk) * sin over every head (transformers' formula); the fused
        path rotates qk in place and returns it."""
        if self.kernels is None:
            return qk * cos[:, None] + rotate_half(qk) * sin[:, None]
        self.kernels.rotary_embedding(qk, cos, sin)
        return qk
