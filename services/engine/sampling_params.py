"""Per-request sampling parameters (the names follow vLLM's `SamplingParams`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each output token and when to stop.

    Raises ValueError naming the field on construction when a value is out of range.
    """

    max_tokens: int = 16
    """Most tokens to generate (>= 1)."""
    temperature: float = 1.0
    """0 means greedy; otherwise logits are divided by it before softmax."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability sums to >= top_p; (0, 1]."""
    top_k: int = -1
    """Keep the k most likely tokens; 0 or -1 disables."""
    seed: int | None = None
    """Makes a sampled request's tokens reproducible, whatever it is batched with."""
    ignore_eos: bool = False
    """Keep generating after the model's EOS token."""
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    """Extra token ids that end the request (finish_reason "stop")."""

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature: must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k: must be >= -1 (0 and -1 disable it), got {self.top_k}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
