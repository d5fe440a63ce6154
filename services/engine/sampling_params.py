"""Per-request sampling parameters (the names follow vLLM's `SamplingParams`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Below this temperature sampling is greedy (vLLM's _SAMPLING_EPS): dividing logits by a
# vanishing temperature would overflow to inf.
GREEDY_TEMPERATURE = 1e-5
# Most top alternatives a request may ask for per token (OpenAI's top_logprobs limit).
MAX_LOGPROBS = 20


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each output token and when to stop.

    Raises ValueError naming the field on construction when a value is out of range.
    """

    max_tokens: int = 16
    """Most tokens to generate (>= 1)."""
    temperature: float = 1.0
    """0 (or below 1e-5) means greedy; otherwise logits are divided by it before softmax."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability sums to >= top_p;
    (0, 1]."""
    top_k: int = -1
    """Keep the k most likely tokens; 0 or -1 disables."""
    seed: int | None = None
    """Makes a sampled request's tokens reproducible whatever it is batched with (in float32;
    bfloat16 matmuls differ slightly between batch shapes). None: the engine draws one."""
    ignore_eos: bool = False
    """Keep generating after the model's EOS token."""
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    """Extra token ids that end the request (finish_reason "stop")."""
    logprobs: int | None = None
    """Return each sampled token's log-probability and this many top alternatives (0..20);
    None returns none. Log-probabilities are of the model's raw distribution (before
    temperature, top-k and top-p), as vLLM reports them by default."""

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_real(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature: must be a finite number >= 0, got {self.temperature!r}")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(
                f"top_k: must be an integer >= -1 (0 and -1 disable it), got {self.top_k!r}"
            )
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed: must be an integer, got {self.seed!r}")
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(
                f"logprobs: must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}"
            )
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(
                f"stop_token_ids: must be non-negative integers, got {self.stop_token_ids!r}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE
