"""The sampling fields of an OpenAI-compatible request, checked by type and turned into the
worker protocol's `SamplingParams` (value ranges are checked again, with the same field names,
by `services.engine.SamplingParams`).

Fields: max_tokens (chat: max_completion_tokens wins over it, as OpenAI documents), temperature,
top_p, top_k (extension, as vLLM), seed, stop, ignore_eos (extension), presence_penalty,
frequency_penalty, repetition_penalty (extension, as vLLM), logit_bias ({"token id": bias}),
logprobs (completions: 0..20 alternatives; chat: a bool with top_logprobs 0..20).
"""

from __future__ import annotations

import re
from typing import Any

from services.common.pb import common_pb2
from services.engine.errors import InvalidRequestError

INT32_MAX = 2**31 - 1
UINT64_MAX = 2**64 - 1
MAX_LOGPROBS = 20
_TOKEN_ID = re.compile(r"[0-9]{1,10}")  # ASCII digits only (int() also takes " 5" and "٥")
MAX_LOGIT_BIAS_ENTRIES = 1024  # OpenAI's own limit is 300; ids beyond the vocab are refused later


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


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
    """body[name] checked to be `kind` ("int", "number" or "bool"); None when absent or null."""
    value = body.get(name)
    if value is None:
        return None
    if kind == "bool" and not isinstance(value, bool):
        raise InvalidRequestError(name, f"must be true or false, got {value!r:.40}")
    if kind == "number" and not (is_int(value) or isinstance(value, float)):
        raise InvalidRequestError(name, f"must be a number, got {value!r:.40}")
    if kind == "int" and not is_int(value):
        raise InvalidRequestError(name, f"must be an integer, got {value!r:.40}")
    if kind == "int" and not low <= value <= high:
        raise InvalidRequestError(name, f"must be an integer in [{low}, {high}], got {value}")
    return value


def _stop_strings(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [checked_text(stop, "stop")]
    if isinstance(stop, list):
        return [checked_text(s, f"stop[{i}]") for i, s in enumerate(stop)]
    raise InvalidRequestError("stop", "must be a string or a list of strings")


def _logit_bias(body: dict) -> dict[int, float]:
    """OpenAI's {"token id": bias in [-100, 100]} (JSON keys are strings)."""
    bias = body.get("logit_bias")
    if bias is None:
        return {}
    if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidRequestError(
            "logit_bias", f"must be an object of at most {MAX_LOGIT_BIAS_ENTRIES} token ids"
        )
    out = {}
    for key, value in bias.items():
        if not _TOKEN_ID.fullmatch(key):
            raise InvalidRequestError("logit_bias", f"key {key!r:.40} is not a token id")
        token_id = int(key)
        if not 0 <= token_id <= INT32_MAX:
            raise InvalidRequestError("logit_bias", f"token id {token_id} is out of range")
        if not (is_int(value) or isinstance(value, float)):
            raise InvalidRequestError(f"logit_bias.{key}", f"must be a number, got {value!r:.40}")
        out[token_id] = float(value)
    return out


def _max_tokens(body: dict, chat: bool) -> int | None:
    """OpenAI's precedence: max_completion_tokens (chat) over the older max_tokens."""
    max_tokens = optional(body, "max_tokens", "int", 1)
    if chat:
        newer = optional(body, "max_completion_tokens", "int", 1)
        return newer if newer is not None else max_tokens
    return max_tokens


def sampling_from_body(body: dict, chat: bool) -> common_pb2.SamplingParams:
    """The sampling fields as a proto (unset fields keep the engine's defaults)."""
    ignore_eos = bool(optional(body, "ignore_eos", "bool"))
    msg = common_pb2.SamplingParams(stop=_stop_strings(body), ignore_eos=ignore_eos)
    for name, value in (
        ("max_tokens", _max_tokens(body, chat)),
        ("temperature", optional(body, "temperature", "number")),
        ("top_p", optional(body, "top_p", "number")),
        ("top_k", optional(body, "top_k", "int")),
        ("seed", optional(body, "seed", "int", 0, UINT64_MAX)),
        ("presence_penalty", optional(body, "presence_penalty", "number")),
        ("frequency_penalty", optional(body, "frequency_penalty", "number")),
        ("repetition_penalty", optional(body, "repetition_penalty", "number")),
    ):
        if value is not None:
            setattr(msg, name, value)
    for token_id, bias in _logit_bias(body).items():
        msg.logit_bias[token_id] = bias
    num_logprobs = _logprobs_asked(body, chat)
    if num_logprobs is not None:
        msg.logprobs = num_logprobs
    return msg


def _logprobs_asked(body: dict, chat: bool) -> int | None:
    """Top alternatives per token, or None when log-probabilities are not asked for."""
    if not chat:
        return optional(body, "logprobs", "int", 0, MAX_LOGPROBS)
    top = optional(body, "top_logprobs", "int", 0, MAX_LOGPROBS)
    if not optional(body, "logprobs", "bool"):
        if top is not None:
            raise InvalidRequestError("top_logprobs", "needs logprobs set to true")
        return None
    return top or 0
