"""Attention over the paged KV cache: one interface, its backends, their choice and self-test."""

# `AttentionMetadata` describes one step's flattened batch; an `AttentionBackend` writes the step's
# new K/V into their slots and computes attention for every query token. Backends (`registry`):
# `torch_sdpa` (torch SDPA over a gather of each request's own positions, the reference),
# `cpu_paged` (pdserve's C++ decode kernel), `triton` (one paged kernel for prefill and decode),
# `flex` (FlexAttention with a paged mask) and `flash_attn` (flash-attn's paged varlen kernel,
# unverified). `self_test` compares the chosen one with SDPA before an engine serves.

from services.engine.attention.base import AttentionBackend, store_kv
from services.engine.attention.cpu_paged import CPUPagedBackend
from services.engine.attention.metadata import AttentionMetadata, PrefillSeq, VarlenLayout
from services.engine.attention.registry import (
    BACKEND_NAMES,
    get_attention_backend,
    resolve_backend_name,
)
from services.engine.attention.sdpa import TorchSDPABackend

__all__ = [
    "BACKEND_NAMES",
    "AttentionBackend",
    "AttentionMetadata",
    "CPUPagedBackend",
    "PrefillSeq",
    "TorchSDPABackend",
    "VarlenLayout",
    "get_attention_backend",
    "resolve_backend_name",
    "store_kv",
]
