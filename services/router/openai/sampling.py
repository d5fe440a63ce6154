"""The sampling fields of an OpenAI-compatible request as the engine's `SamplingParams`, which
checks every value (`services/engine/sampling_params.py`, the one place); here only OpenAI's
shapes: which JSON field feeds which parameter, logit_bias's string keys, stop as a string or a
list, and the error renamed to the field the client sent.

Fields: max_tokens (chat: max_completion_tokens wins over it, as OpenAI documents), temperature,
top_p, top_k (extension, as vLLM), seed, stop, ignore_eos (extension), presence_penalty,
frequency_penalty, repetition_penalty (extension, as vLLM), logit_bias ({"token id": bias}),
logprobs (completions: 0..20 alternatives; chat: a bool with top_logprobs 0..20).
"""

from __future__ import annotations

import math
import re
from typing import Any

from services.engine.errors import InvalidRequestError
from services.engine.sampling_params import INT32_MAX, SamplingParams, is_int

_TOKEN_ID = re.compile(r"[0-9]{1,10}")  # ASCII digits only (int() also takes " 5" and "٥")
# Sampling fields whose JSON name is the parameter's own.
_SAME_NAME = (
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "ignore_eos",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


def checked_text(value: Any, field: str) -> str:
    """`value` if it is a string that UTF-8 can carry (JSON's "\\ud800" escapes decode to lone
    surrogates, which no tokenizer accepts); InvalidRequestError naming `field` otherwise."""
    if not isinstance(value, str):
        raise InvalidRequestError(field, f"must be a string, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(
            field, f"contains a lone UTF-16 surrogate at character {exc.start}"
        ) from None
    return value


def optional(
    body: dict, name: str, kind: str, low: int = -INT32_MAX - 1, high: int = INT32_MAX
) -> Any:
    """body[name] checked to be `kind` ("int" in [low, high], or "bool"); None when absent or
    null. For the request's own fields (n, stream, echo, ...), not the sampling values."""
    value = body.get(name)
    if value is None:
        return None
    if kind == "bool" and not isinstance(value, bool):
        raise InvalidRequestError(name, f"must be true or false, got {value!r:.40}")
    if kind == "int" and not is_int(value, -math.inf, math.inf):
        raise InvalidRequestError(name, f"must be an integer, got {value!r:.40}")
    if kind == "int" and not low <= value <= high:
        raise InvalidRequestError(name, f"must be an integer in [{low}, {high}], got {value}")
    return value


def stop_strings(body: dict) -> tuple[str, ...]:
    """`stop`: a string or a list of strings (their values are checked with the request)."""
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (checked_text(stop, "stop"),)
    if isinstance(stop, list):
        return tuple(checked_text(s, f"stop[{i}]") for i, s in enumerate(stop))
    raise InvalidRequestError("stop", "must be a string or a list of strings")


def _logit_bias(bias: Any) -> dict[int, Any]:
    """OpenAI's {"token id": bias} (JSON keys are strings) keyed by int."""
    if not isinstance(bias, dict):
        raise InvalidRequestError("logit_bias", "must be an object mapping token ids to biases")
    out = {}
    for key, value in bias.items():
        if not _TOKEN_ID.fullmatch(key):
            raise InvalidRequestError("logit_bias", f"key {key!r:.40} is not a token id")
        out[int(key)] = value
    return out


def sampling_from_body(body: dict, chat: bool) -> SamplingParams:
    """The sampling fields as `SamplingParams` (absent or null ones keep the engine's defaults);
    InvalidRequestError naming the field as the client sent it."""
    fields = {name: body[name] for name in _SAME_NAME if body.get(name) is not None}
    sent_as = {}  # parameter -> the JSON field that gave it, where the two names differ
    max_tokens = "max_tokens"
    if chat and body.get("max_completion_tokens") is not None:  # OpenAI's precedence
        max_tokens = sent_as["max_tokens"] = "max_completion_tokens"
    if body.get(max_tokens) is not None:
        fields["max_tokens"] = body[max_tokens]
    if body.get("logit_bias") is not None:
        fields["logit_bias"] = _logit_bias(body["logit_bias"])
    if chat:
        sent_as["logprobs"] = "top_logprobs"
    logprobs = _logprobs_asked(body, chat)
    if logprobs is not None:
        fields["logprobs"] = logprobs
    try:
        return SamplingParams(**fields)
    except ValueError as exc:
        field, _, message = str(exc).partition(": ")
        raise InvalidRequestError(sent_as.get(field, field), message) from None


def _logprobs_asked(body: dict, chat: bool) -> Any:
    """Top alternatives per token (checked as SamplingParams.logprobs), or None when
    log-probabilities are not asked for."""
    if not chat:
        return body.get("logprobs")
    top = body.get("top_logprobs")
    if not optional(body, "logprobs", "bool"):
        if top is not None:
            raise InvalidRequestError("top_logprobs", "needs logprobs set to true")
        return None
    return 0 if top is None else top
