"""The name of a request's pinned prompt KV, as it travels between engines (imports no torch)."""

from __future__ import annotations

from dataclasses import dataclass

# Axis order of every transferred tensor (C order), the KV cache's own layout per block.
KV_TENSOR_LAYOUT = "layers,kv,blocks,block_size,kv_heads,head_dim"


@dataclass(frozen=True)
class KVHandle:
    """Where a request's prompt KV lives on its source engine.

    `num_tokens` prompt tokens have K/V in `block_ids` (in block-table order) on engine
    `engine_id`; `first_token_id` is the token the prefill sampled from the prompt's last logits.
    """

    request_id: str
    engine_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    first_token_id: int
