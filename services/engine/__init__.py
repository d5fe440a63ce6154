"""The transport-free engine: paged KV cache, scheduler, model runner, sampler, detokenizer."""

# Nothing in this package imports grpc, ray, prometheus or an HTTP stack. The heavy parts (torch,
# transformers) load on first use of `Engine` or `LLM`, so the light modules the router shares
# (errors, config, sampling params, block hashing, KV events, request validation, the tokenizer
# and detokenizer) import without them.

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from services.engine.config import EngineConfig, EngineRole
from services.engine.outputs import CompletionOutput, RequestOutput
from services.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from services.engine.engine import Engine
    from services.engine.llm import LLM

_LAZY = {"Engine": "services.engine.engine", "LLM": "services.engine.llm"}

__all__ = [
    "LLM",
    "CompletionOutput",
    "Engine",
    "EngineConfig",
    "EngineRole",
    "RequestOutput",
    "SamplingParams",
]


def __getattr__(name: str) -> Any:
    """`Engine` and `LLM` import torch: load them when first asked for (PEP 562)."""
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
