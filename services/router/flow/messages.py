"""What the request flow takes and yields: a `GenerationRequest`, and its `GenerationOutput`s.

Plain frozen dataclasses, so the flow knows no wire format: the gRPC servicer
(`router/convert.py`) and the HTTP API (`router/openai/`) build the request from their own
messages and render the outputs back. Every output carries the new token ids, their text and
(when asked for) their log-probabilities; the last one also the finish_reason, the usage and
the timings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from services.engine.errors import InvalidRequestError
from services.engine.outputs import TokenLogprobs
from services.engine.sampling_params import SamplingParams, check_stop_strings
from services.engine.validation import check_cache_salt

PROMPT_KINDS = ("text", "token_ids", "chat")


@dataclass(frozen=True)
class ChatMessage:
    """One chat message; the roles the flow knows are `prompt.CHAT_ROLES`."""

    role: str
    content: str


@dataclass(frozen=True)
class GenerationRequest:
    """One sequence to generate. Exactly one of `text`, `token_ids` and `chat` is the prompt.

    Raises (on construction) InvalidRequestError naming `prompt` unless exactly one prompt is
    set, `cache_salt` for an empty or over-long salt; ValueError naming `stop` for an empty
    stop string. The sampling values were checked when `sampling` was built; what depends on
    the model (vocabulary, max_model_len, the tokenizer) is checked by `prompt.prepare_request`.
    """

    text: str | None = None
    """A prompt to tokenize as is (no special tokens added)."""
    token_ids: tuple[int, ...] | None = None
    """A prompt given as token ids."""
    chat: tuple[ChatMessage, ...] | None = None
    """A chat, rendered with the model's chat template."""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    """Stop strings: the text ends before the first one (applied by the router to the text,
    never sent to workers)."""
    cache_salt: str | None = None
    """Requests share cached prefix KV only with requests of the same salt (None: no salt)."""
    request_id: str = ""
    """The client's id for the request ("": none); the workers' ids start with it."""
    itl_objective_ms: float | None = None
    """This stream's ITL objective (milliseconds; None: the decode worker's default)."""
    tpot_objective_ms: float | None = None
    """This stream's mean-TPOT objective (milliseconds; None: the decode worker's default)."""
    ttft_objective_ms: float | None = None
    """This request's TTFT objective (milliseconds; None: the router's --slo-ttft-ms): which
    serving path its prompt takes (`serving_path.py`)."""

    def __post_init__(self) -> None:
        if sum(getattr(self, kind) is not None for kind in PROMPT_KINDS) != 1:
            raise InvalidRequestError("prompt", "set exactly one of text, token_ids, chat")
        if self.token_ids is not None:
            object.__setattr__(self, "token_ids", tuple(self.token_ids))
        if self.chat is not None:
            object.__setattr__(self, "chat", tuple(self.chat))
        object.__setattr__(self, "stop", check_stop_strings(self.stop))
        check_cache_salt(self.cache_salt)
        for name in ("itl_objective_ms", "tpot_objective_ms", "ttft_objective_ms"):
            ms = getattr(self, name)
            number = isinstance(ms, (int, float)) and not isinstance(ms, bool)
            if ms is not None and not (number and 0 < ms < math.inf):
                raise InvalidRequestError(name, f"must be > 0 milliseconds, got {ms!r}")


@dataclass(frozen=True)
class Usage:
    """Tokens of one finished sequence."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    """Prompt tokens whose KV a worker took from its prefix cache instead of computing it."""


@dataclass(frozen=True)
class Timings:
    """Where one request's time went, in seconds, as the router measured it (with the workers'
    own compute figures); `request_stats.py` defines each leg. The fields are in the order of
    `Timings` in generate.proto, which is the order the APIs report them in."""

    ttft: float
    e2e: float
    tokenize: float
    prefill: float
    kv_transfer: float
    decode: float
    router_queue: float
    prefill_queue: float
    decode_queue: float
    first_decode_step: float
    path: str
    """"remote" (prefilled on the prefill pool) or "local" (on its decode worker)."""
    migrations: int
    """Times the stream moved to another worker."""
    migration: float
    path_reason: str = "mode"
    """Why `path` (`serving_path.MODES`): --disaggregation, the length rule, the lower predicted
    TTFT, or the least delay to running streams within the TTFT objective."""
    predicted_ttft_local: float = 0.0
    """With path_reason "predicted" or "objective": each path's predicted TTFT (seconds), else
    0."""
    predicted_ttft_remote: float = 0.0


@dataclass(frozen=True)
class GenerationOutput:
    """One step of a sequence's stream: new tokens and text; the last also says why it ended."""

    token_ids: tuple[int, ...]
    """The tokens new in this output."""
    text: str
    """Their text (UTF-8 safe; a stop string and what follows it never appear)."""
    logprobs: tuple[TokenLogprobs, ...] = ()
    """One per token of `token_ids` when the sampling asked for them, else empty."""
    finish_reason: str | None = None
    """None until the last output: then "stop" or "length"."""
    usage: Usage | None = None
    """The last output's only."""
    timings: Timings | None = None
    """The last output's only."""
