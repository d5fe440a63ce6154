"""pdserve's engine: paged KV cache, scheduler, model runner, sampler, detokenizer, KV transfer.

Transport-free: nothing in this package imports grpc, ray, prometheus or an HTTP stack.
"""

from services.engine.config import EngineConfig, EngineRole
from services.engine.engine import Engine
from services.engine.outputs import CompletionOutput, RequestOutput
from services.engine.sampling_params import SamplingParams

__all__ = [
    "CompletionOutput",
    "Engine",
    "EngineConfig",
    "EngineRole",
    "RequestOutput",
    "SamplingParams",
]
