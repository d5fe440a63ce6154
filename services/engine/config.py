"""Engine configuration: one frozen, validated dataclass."""

from __future__ import annotations

import enum
import uuid
from dataclasses import dataclass, field

import torch

from services.engine.attention import BACKEND_NAMES

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class EngineRole(enum.Enum):
    """What an engine does with a request (ARCHITECTURE.md, "Engine roles")."""

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

    model: str = "smollm2-135m-instruct"
    """Local Hugging Face folder or the name `smollm2-135m-instruct`."""
    role: EngineRole = EngineRole.BOTH
    """BOTH, PREFILL or DECODE."""
    device: str = "cpu"
    """torch device string: "cpu" or "cuda[:N]"."""
    dtype: str | None = None
    """float32 | bfloat16 | float16; None picks `default_dtype(device)`."""
    block_size: int = 16
    """Tokens per KV block."""
    kv_cache_memory_bytes: int = 1 << 30
    """Memory budget for K and V of all layers, in bytes; sets the number of blocks."""
    num_blocks: int | None = None
    """Exact number of KV blocks; overrides `kv_cache_memory_bytes` when set."""
    max_model_len: int | None = None
    """Longest prompt + output in tokens; None takes the model's max_position_embeddings."""
    max_num_seqs: int = 256
    """Most requests running in one step."""
    max_num_batched_tokens: int = 8192
    """Most tokens (prompt + decode) computed in one step; a longer prompt is chunked."""
    seed: int | None = None
    """Seeds block-list shuffling and the seeds drawn for requests without one; None: random."""
    shuffle_free_blocks: bool = False
    """Hand out blocks in random order (tests use it to catch reads outside a block table)."""
    enable_prefix_caching: bool = True
    """Reuse the KV of cached full blocks across requests (automatic prefix caching)."""
    enable_kv_events: bool = False
    """Record prefix-cache events (blocks stored / removed) for `Engine.take_kv_events`."""
    attention_backend: str = "auto"
    """"torch_sdpa" (pure torch), "cpu_paged" (C++ paged decode kernel) or "auto" (cpu_paged on
    the CPU when its kernel builds, else torch_sdpa)."""
    kv_transfer_timeout_s: float = 30.0
    """DECODE role: seconds a request may wait for its prompt KV (blocks to reserve, then the
    pull) before it fails; the destination of a stalled transfer gives up after this long."""
    max_num_waiting_for_kv: int = 64
    """DECODE role: most requests queued for KV blocks when the cache is full; one more is
    refused with ResourceExhaustedError (RESOURCE_EXHAUSTED) instead of waiting unbounded."""
    engine_id: str = field(default_factory=lambda: f"engine-{uuid.uuid4().hex[:12]}")
    """Name of this engine in KV handles; unique within a cluster (random by default)."""

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model: must be a folder path or a known model name")
        if not isinstance(self.role, EngineRole):
            raise ValueError(f"role: expected EngineRole, got {self.role!r}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device: expected 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.dtype is not None and self.dtype not in _DTYPES:
            raise ValueError(f"dtype: expected one of {sorted(_DTYPES)}, got {self.dtype!r}")
        for name in (
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "kv_cache_memory_bytes",
            "max_num_waiting_for_kv",
        ):
            _check_positive_int(name, getattr(self, name))
        for name in ("num_blocks", "max_model_len"):
            if getattr(self, name) is not None:
                _check_positive_int(name, getattr(self, name))
        for name in ("enable_prefix_caching", "enable_kv_events", "shuffle_free_blocks"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: must be True or False, got {getattr(self, name)!r}")
        if self.seed is not None and (
            not isinstance(self.seed, int) or isinstance(self.seed, bool)
        ):
            raise ValueError(f"seed: must be an integer, got {self.seed!r}")
        if self.attention_backend not in BACKEND_NAMES:
            raise ValueError(
                f"attention_backend: expected one of {list(BACKEND_NAMES)}, got {self.attention_backend!r}"
            )
        if not (
            isinstance(self.kv_transfer_timeout_s, (int, float)) and self.kv_transfer_timeout_s > 0
        ):
            raise ValueError(
                f"kv_transfer_timeout_s: must be > 0 seconds, got {self.kv_transfer_timeout_s!r}"
            )
        if not self.engine_id:
            raise ValueError("engine_id: must not be empty")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device: {self.device!r} requested but CUDA is not available")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype or default_dtype(self.device)]
