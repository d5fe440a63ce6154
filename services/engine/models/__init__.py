"""Model families: a registry from Hugging Face `model_type` to our paged forward."""

from __future__ import annotations

from services.engine.models.llama import SUPPORTED_MODEL_TYPES, PagedLlamaForCausalLM

MODEL_REGISTRY = {model_type: PagedLlamaForCausalLM for model_type in SUPPORTED_MODEL_TYPES}

__all__ = ["MODEL_REGISTRY", "PagedLlamaForCausalLM"]
