"""Per-request sampling parameters (the names follow vLLM's `SamplingParams`): the one place
every sampling field is validated, for the engine, the router's HTTP and gRPC APIs and the CLI.

Values must also fit the worker protocol (`common.proto`): counts and token ids are int32, the
seed uint64, the floats float32, so whatever the router accepts reaches a worker unchanged.
Stop strings are not the engine's (it sees token ids only): the router applies them, and
`check_stop_strings` validates them here with the rest.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

# Below this temperature sampling is greedy (vLLM's _SAMPLING_EPS): dividing logits by a
# vanishing temperature would overflow to inf.
GREEDY_TEMPERATURE = 1e-5
# Most top alternatives a request may ask for per token (OpenAI's top_logprobs limit).
MAX_LOGPROBS = 20
# Ranges of OpenAI's API, which vLLM's SamplingParams checks too.
MAX_ABS_PENALTY = 2.0  # presence_penalty, frequency_penalty
MAX_ABS_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_ENTRIES = 1024  # OpenAI's own limit is 300
# The worker protocol's integer and float types (common.proto).
INT32_MAX = 2**31 - 1
UINT64_MAX = 2**64 - 1
FLOAT32_MAX = 3.4028234663852886e38


def is_int(value: object, low: float = -INT32_MAX - 1, high: float = INT32_MAX) -> bool:
    """An integer (not a bool) in [low, high] (default: an int32; math.inf for no bound). The
    one integer check of the API's values, the HTTP API's included."""
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _is_real(value: object) -> bool:
    """A number (not a bool) that is finite as a float32 (NaN compares False)."""
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and abs(value) <= FLOAT32_MAX
    )


def check_stop_strings(stop: Iterable[str]) -> tuple[str, ...]:
    """Stop strings (the router ends the text where one appears) as a tuple; ValueError naming
    `stop` unless they are a list of non-empty strings."""
    strings = None if isinstance(stop, str) else tuple(stop)
    if strings is None or not all(isinstance(s, str) for s in strings):
        raise ValueError(f"stop: must be a list of strings, got {stop!r:.80}")
    if not all(strings):
        raise ValueError("stop: stop strings must not be empty")
    return strings


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each output token and when to stop.

    Raises ValueError naming the field on construction when a value is out of range.
    """

    max_tokens: int = 16
    """Most tokens to generate, in [1, 2**31)."""
    temperature: float = 1.0
    """0 (or below 1e-5) means greedy; otherwise logits are divided by it before softmax."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability sums to >= top_p;
    (0, 1]."""
    top_k: int = -1
    """Keep the k most likely tokens (< 2**31); 0 or -1 disables."""
    seed: int | None = None
    """In [0, 2**64): makes a sampled request's tokens reproducible whatever it is batched with
    (in float32; bfloat16 matmuls differ slightly between batch shapes). None: the engine draws
    one."""
    ignore_eos: bool = False
    """Keep generating after the model's EOS token."""
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    """Extra token ids that end the request (finish_reason "stop"); each in [0, 2**31)."""
    logprobs: int | None = None
    """Return each sampled token's log-probability and this many top alternatives (0..20);
    None returns none. Log-probabilities are of the model's raw distribution (before logit
    bias, penalties, temperature, top-k and top-p), as vLLM reports them by default."""
    presence_penalty: float = 0.0
    """In [-2, 2]: subtracted once from the logit of every token that occurs in the output so
    far (OpenAI's definition, as vLLM's `apply_penalties`); > 0 favours new tokens."""
    frequency_penalty: float = 0.0
    """In [-2, 2]: subtracted from each token's logit once per occurrence of the token in the
    output so far (OpenAI's definition, as vLLM's `apply_penalties`)."""
    repetition_penalty: float = 1.0
    """Finite and > 0 (the rule of vLLM's vllm/sampling_params.py; 1 disables): the logit of
    every token that occurs in the prompt or the output so far is divided by it when positive
    and multiplied by it otherwise (Keskar et al. 2019, CTRL; vLLM's `apply_penalties`,
    transformers' `RepetitionPenaltyLogitsProcessor`); > 1 discourages repeats."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """Added to the raw logits of the given token ids before any penalty (vLLM's
    `LogitBiasLogitsProcessor`); biases in [-100, 100] (OpenAI's range: vLLM clamps to it, this
    refuses values outside), at most 1024 token ids. Pass a dict {token_id: bias} or (token_id,
    bias) pairs; stored as pairs sorted by token id, so the params stay frozen and hashable."""

    def __post_init__(self) -> None:
        if not is_int(self.max_tokens, 1):
            raise ValueError(
                f"max_tokens: must be an integer in [1, {INT32_MAX}], got {self.max_tokens!r:.40}"
            )
        if not _is_real(self.temperature) or self.temperature < 0:
            raise ValueError(
                f"temperature: must be a finite number >= 0, got {self.temperature!r:.40}"
            )
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p!r:.40}")
        if not is_int(self.top_k, -1):
            raise ValueError(
                f"top_k: must be an integer in [-1, {INT32_MAX}] (0 and -1 disable it), "
                f"got {self.top_k!r:.40}"
            )
        if self.seed is not None and not is_int(self.seed, 0, UINT64_MAX):
            raise ValueError(f"seed: must be an integer in [0, 2**64), got {self.seed!r:.40}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos: must be true or false, got {self.ignore_eos!r:.40}")
        if self.logprobs is not None and not is_int(self.logprobs, 0, MAX_LOGPROBS):
            raise ValueError(
                f"logprobs: must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r:.40}"
            )
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not all(is_int(t, 0) for t in self.stop_token_ids):
            raise ValueError(
                f"stop_token_ids: must be integers in [0, {INT32_MAX}], "
                f"got {list(self.stop_token_ids)!r:.80}"
            )
        self._check_penalties()
        object.__setattr__(self, "logit_bias", _frozen_logit_bias(self.logit_bias))

    def _check_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -MAX_ABS_PENALTY <= value <= MAX_ABS_PENALTY:
                raise ValueError(f"{name}: must be in [-2, 2], got {value!r:.40}")
        if not _is_real(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(
                "repetition_penalty: must be a finite number > 0, "
                f"got {self.repetition_penalty!r:.40}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def adjusts_logits(self) -> bool:
        """Whether a logit bias or any penalty is set (else the sampler skips that stage)."""
        return bool(
            self.logit_bias
            or self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )


def _frozen_logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    """A dict or iterable of (token_id, bias) pairs -> pairs sorted by token id; ValueError
    naming `logit_bias` for anything else, more than MAX_LOGIT_BIAS_ENTRIES pairs, a repeated
    id, an id outside [0, 2**31) or a bias out of range."""
    items: Any = value.items() if isinstance(value, Mapping) else value
    try:
        pairs = [(token_id, bias) for token_id, bias in items]
    except (TypeError, ValueError):
        raise ValueError(f"logit_bias: must map token ids to biases, got {value!r:.80}") from None
    if len(pairs) > MAX_LOGIT_BIAS_ENTRIES:
        raise ValueError(
            f"logit_bias: at most {MAX_LOGIT_BIAS_ENTRIES} token ids, got {len(pairs)}"
        )
    for token_id, bias in pairs:
        if not is_int(token_id, 0):
            raise ValueError(
                f"logit_bias: token ids must be non-negative integers below 2**31, "
                f"got {token_id!r:.40}"
            )
        if not _is_real(bias) or not -MAX_ABS_LOGIT_BIAS <= bias <= MAX_ABS_LOGIT_BIAS:
            raise ValueError(
                f"logit_bias: must be in [-100, 100], got {bias!r:.40} for token {token_id}"
            )
    if len({token_id for token_id, _ in pairs}) != len(pairs):
        raise ValueError("logit_bias: a token id appears twice")
    return tuple(sorted((int(t), float(b)) for t, b in pairs))
