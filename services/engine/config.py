"""Engine configuration: one frozen, validated dataclass.

Imports no torch: the router, the CLI and `pdserve --help` read it (flags are generated from its
fields, `services/flags.py`); `torch_dtype` imports torch when an engine asks for it.
"""

from __future__ import annotations

import enum
import re
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from services.flags import flag
from services.kv_transfer.lease import DEFAULT_LEASE_S

if TYPE_CHECKING:
    import torch

DTYPES = ("float32", "bfloat16", "float16")
_DEVICE = re.compile(r"cpu|cuda(:\d+)?")
ATTENTION_BACKENDS = ("auto", "torch_sdpa", "cpu_paged", "triton", "flex", "flash_attn")
DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30


class EngineRole(enum.Enum):
    """What an engine does with a request (docs/architecture.md, "Engine roles")."""

    BOTH = "both"  # prefill and decode in one engine
    PREFILL = "prefill"  # run the prompt, sample the first token, keep the KV for export
    DECODE = "decode"  # admit requests whose prompt KV arrives through KV transfer


def default_dtype(device: str) -> str:
    """float32 on the CPU (exactness against the reference), bfloat16 on CUDA."""
    return "bfloat16" if device.startswith("cuda") else "float32"


def _check_positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}: must be an integer >= 1, got {value!r}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything an `Engine` needs; validated at construction (ValueError naming the field)."""

    model: str = DEFAULT_MODEL
    """Local Hugging Face folder or the name `smollm2-135m-instruct`."""
    role: EngineRole = field(default=EngineRole.BOTH, metadata=flag(cli=False))
    """BOTH, PREFILL or DECODE."""
    device: str = "cpu"
    """torch device: "cpu" or "cuda[:N]" (CUDA is checked when the engine starts)."""
    dtype: str | None = field(default=None, metadata=flag(choices=DTYPES))
    """Weights and KV cache dtype (default: float32 on the CPU, bfloat16 on CUDA)."""
    block_size: int = 16
    """Tokens per KV block."""
    kv_cache_memory_bytes: int | None = field(default=None, metadata=flag(name="kv-cache-bytes"))
    """Memory budget for K and V of all layers, in bytes; sets the number of blocks (default:
    1 GiB on the CPU; on CUDA what --gpu-memory-utilization leaves after a profiling forward)."""
    gpu_memory_utilization: float = 0.9
    """CUDA: fraction of the device's memory this engine may use (weights, activations, KV
    cache), as vLLM's flag; the KV cache gets what the rest leaves."""
    enforce_eager: bool = False
    """CUDA: run every decode step eagerly instead of replaying CUDA graphs."""
    max_cuda_graph_batch_size: int = 256
    """CUDA: the largest decode batch captured as a CUDA graph (sizes 1, 2, 4, 8, then every 8
    up to this or max_num_seqs); larger batches run eagerly."""
    num_blocks: int | None = None
    """Exact number of KV blocks; when set, the byte budget above is ignored."""
    max_model_len: int | None = None
    """Longest prompt + output in tokens (default: the model's max_position_embeddings)."""
    max_num_seqs: int = 256
    """Most requests running in one step."""
    max_num_batched_tokens: int = 8192
    """Most tokens (prompt + decode) computed in one step; a longer prompt is chunked."""
    slo_itl_ms: float | None = None
    """ITL objective (milliseconds) of a stream that brings none: a step that mixes prompt
    tokens into running decodes takes the largest chunk whose predicted time fits the tightest
    running stream's objective (needs the cost model of `pdserve profile`; without one only
    --max-num-batched-tokens caps it). Default: none for a stream that brings a TPOT objective
    (its slack bounds the step), else 5x the predicted decode-only step of the rows running
    (Sarathi-Serve's strict objective), so on any machine a prompt stretches the streams' gaps
    to a few of their own steps at most."""
    slo_tpot_ms: float = 100.0
    """Mean-TPOT objective (milliseconds) of every stream: a stream's ITL allowance shrinks to
    the time left before its mean TPOT would pass this (never below it), so a prefill chunk only
    takes the slack streams have (DistServe's chat objective, 0.1 s)."""
    seed: int | None = None
    """Seed of the engine's own draws: the sampling seed of a request that brings none
    (default: random)."""
    shuffle_free_blocks: bool = field(default=False, metadata=flag(cli=False))
    """Hand out blocks in random order (tests use it to catch reads outside a block table)."""
    enable_prefix_caching: bool = True
    """Reuse the KV of cached full blocks across requests (automatic prefix caching)."""
    enable_kv_events: bool = field(default=False, metadata=flag(cli=False))
    """Record prefix-cache events (blocks stored / removed) for `Engine.take_kv_events`."""
    attention_backend: str = field(default="auto", metadata=flag(choices=ATTENTION_BACKENDS))
    """"torch_sdpa", "cpu_paged" (C++ decode kernel and, without AMX, blocked bfloat16 prefill;
    CPU), "triton", "flex" (FlexAttention),
    "flash_attn" (block_size a multiple of 256), or "auto": on the CPU cpu_paged when its kernel
    builds, else torch_sdpa; on CUDA flash_attn where it imports and the block size allows, else
    triton, else flex."""
    kv_transfer_timeout_s: float = field(default=30.0, metadata=flag(name="kv-transfer-timeout"))
    """DECODE role: seconds a request may wait for its prompt KV (blocks to reserve, then the
    pull) before it fails; the destination of a stalled transfer gives up after this long."""
    max_num_waiting_for_kv: int = 64
    """DECODE role: most requests queued for KV blocks when the cache is full; one more is
    refused at once (RESOURCE_EXHAUSTED) instead of waiting unbounded."""
    kv_lease_seconds: float = DEFAULT_LEASE_S
    """PREFILL role: seconds a finished request's prompt KV stays pinned without a renewal from
    its decode worker; then its blocks are freed."""
    debug_recompute_prompt: bool = field(default=False, metadata=flag(cli=False))
    """Test hook (DECODE role; `pdserve decode --debug-recompute-prompt`): release every
    incoming request's prompt KV unread and prefill the prompt here instead, the "quietly not
    P/D" failure the recompute alert exists for (deploy/prometheus/alerts.yml)."""
    engine_id: str = field(default_factory=lambda: f"engine-{uuid.uuid4().hex[:12]}")
    """Name of this engine in KV handles; unique within a cluster (default: generated)."""

    def __post_init__(self) -> None:
        if not self.model or not isinstance(self.model, str):
            raise ValueError(
                f"model: must be a folder path or a known model name, got {self.model!r}"
            )
        if not isinstance(self.role, EngineRole):
            raise ValueError(f"role: expected EngineRole, got {self.role!r}")
        if not isinstance(self.device, str) or not _DEVICE.fullmatch(self.device):
            raise ValueError(f"device: expected 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype: expected one of {list(DTYPES)}, got {self.dtype!r}")
        for name in (
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_num_waiting_for_kv",
            "max_cuda_graph_batch_size",
        ):
            _check_positive_int(name, getattr(self, name))
        for name in ("num_blocks", "max_model_len", "kv_cache_memory_bytes"):
            if getattr(self, name) is not None:
                _check_positive_int(name, getattr(self, name))
        for name in (
            "enable_prefix_caching",
            "enable_kv_events",
            "shuffle_free_blocks",
            "debug_recompute_prompt",
            "enforce_eager",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: must be True or False, got {getattr(self, name)!r}")
        if self.seed is not None and (
            not isinstance(self.seed, int) or isinstance(self.seed, bool)
        ):
            raise ValueError(f"seed: must be an integer, got {self.seed!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend: expected one of {list(ATTENTION_BACKENDS)}, "
                f"got {self.attention_backend!r}"
            )
        utilization = self.gpu_memory_utilization
        if (
            isinstance(utilization, bool)
            or not isinstance(utilization, (int, float))
            or not (0 < utilization <= 1)
        ):
            raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {utilization!r}")
        for name in ("kv_transfer_timeout_s", "kv_lease_seconds", "slo_itl_ms", "slo_tpot_ms"):
            value = getattr(self, name)
            if name == "slo_itl_ms" and value is None:  # relative to the decode step
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                unit = "milliseconds" if name.endswith("_ms") else "seconds"
                raise ValueError(f"{name}: must be > 0 {unit}, got {value!r}")
        if not self.engine_id or not isinstance(self.engine_id, str):
            raise ValueError("engine_id: must be a non-empty string")

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype of weights and KV cache (imports torch)."""
        import torch

        return getattr(torch, self.dtype or default_dtype(self.device))
