"""OpenAI-compatible request parsing (completions and chat completions).

Only the JSON shapes live here (responses: `openai_responses.py`); `http_api.py` serves them
and `generate.py` runs the request.
Supported request fields: model, prompt (completions: a string, a list of token ids, or a
one-element list of either) / messages (chat), max_tokens (chat also max_completion_tokens),
temperature, top_p, top_k (extension, as in vLLM), seed, stop (string or list), stream,
stream_options.include_usage, ignore_eos (extension), cache_salt (extension, as in vLLM: requests
share cached prefixes only with the same salt), n and best_of (1 only), and log-probabilities:
completions `logprobs` (0..20 alternatives), chat `logprobs` (bool) with `top_logprobs` (0..20).
Token strings in logprobs are each token decoded on its own (a character split across tokens
shows as U+FFFD there; `bytes` are that string's UTF-8). echo, suffix and tools are refused when
set (400); other unknown fields are ignored, as OpenAI-compatible servers do. Defaults are the
engine's (max_tokens 16, temperature 1.0).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from services.common.pb import common_pb2, generate_pb2
from services.engine.errors import InvalidRequestError

INT32_MAX = 2**31 - 1
UINT64_MAX = 2**64 - 1
# Asking for these would silently get something else, so they are refused.
UNSUPPORTED = ("echo", "suffix", "tools")
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class OpenAIRequest:
    """A parsed request: the Generate call plus how to shape the reply."""

    generate: generate_pb2.GenerateRequest
    chat: bool
    stream: bool
    include_usage: bool
    logprobs: bool = False  # render log-probabilities in the reply
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def response_id(self) -> str:
        return ("chatcmpl-" if self.chat else "cmpl-") + self.request_id


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _optional(
    body: dict, name: str, kind: str, low: int = -INT32_MAX - 1, high: int = INT32_MAX
) -> Any:
    """body[name] checked to be `kind` ("int", "number" or "bool"); None when absent or null."""
    value = body.get(name)
    if value is None:
        return None
    if kind == "bool" and not isinstance(value, bool):
        raise InvalidRequestError(name, f"must be true or false, got {value!r}")
    if kind == "number" and not (_is_int(value) or isinstance(value, float)):
        raise InvalidRequestError(name, f"must be a number, got {value!r}")
    if kind == "int" and not _is_int(value):
        raise InvalidRequestError(name, f"must be an integer, got {value!r}")
    if kind == "int" and not low <= value <= high:
        raise InvalidRequestError(name, f"must be in [{low}, {high}], got {value}")
    return value


def _stop_strings(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return stop
    raise InvalidRequestError("stop", "must be a string or a list of strings")


def sampling_from_body(body: dict, chat: bool) -> common_pb2.SamplingParams:
    """The sampling fields as a proto; value ranges are checked later by SamplingParams."""
    ignore_eos = bool(_optional(body, "ignore_eos", "bool"))
    msg = common_pb2.SamplingParams(stop=_stop_strings(body), ignore_eos=ignore_eos)
    max_tokens = _optional(body, "max_tokens", "int")
    if chat and max_tokens is None:
        max_tokens = _optional(body, "max_completion_tokens", "int")
    for name, value in (
        ("max_tokens", max_tokens),
        ("temperature", _optional(body, "temperature", "number")),
        ("top_p", _optional(body, "top_p", "number")),
        ("top_k", _optional(body, "top_k", "int")),
        ("seed", _optional(body, "seed", "int", 0, UINT64_MAX)),
    ):
        if value is not None:
            setattr(msg, name, value)
    num_logprobs = _logprobs_asked(body, chat)
    if num_logprobs is not None:
        msg.logprobs = num_logprobs
    return msg


def _logprobs_asked(body: dict, chat: bool) -> int | None:
    """Top alternatives per token, or None when log-probabilities are not asked for."""
    if not chat:
        return _optional(body, "logprobs", "int", 0, MAX_LOGPROBS)
    top = _optional(body, "top_logprobs", "int", 0, MAX_LOGPROBS)
    if not _optional(body, "logprobs", "bool"):
        if top is not None:
            raise InvalidRequestError("top_logprobs", "needs logprobs set to true")
        return None
    return top or 0


def _set_prompt(request: generate_pb2.GenerateRequest, prompt: Any) -> None:
    """Completions `prompt`: a string, token ids, or a one-element list of either."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        request.text = prompt
    elif isinstance(prompt, list) and all(
        _is_int(t) and -INT32_MAX - 1 <= t <= INT32_MAX for t in prompt
    ):
        request.token_ids.ids.extend(prompt)
    else:
        raise InvalidRequestError(
            "prompt", "must be a string, a list of token ids, or a one-element list of either"
        )


def _message_content(message: Any, i: int) -> str:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise InvalidRequestError(f"messages[{i}]", "must be an object with a string role")
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" for p in content
    ):
        return "".join(str(p.get("text", "")) for p in content)
    raise InvalidRequestError(f"messages[{i}].content", "must be a string or a list of text parts")


def _set_messages(request: generate_pb2.GenerateRequest, messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages", "must be a non-empty list")
    for i, message in enumerate(messages):
        request.chat.messages.add(
            role=message["role"] if isinstance(message, dict) else "",
            content=_message_content(message, i),
        )


def parse_request(body: Any, chat: bool) -> OpenAIRequest:
    """Builds the Generate request; InvalidRequestError names the offending field."""
    if not isinstance(body, dict):
        raise InvalidRequestError("body", "must be a JSON object")
    for name in ("n", "best_of"):
        if _optional(body, name, "int") not in (None, 1):
            raise InvalidRequestError(name, "only 1 is supported")
    for name in UNSUPPORTED:
        if body.get(name):  # absent, null, false, 0 and "" all mean "not asked for"
            raise InvalidRequestError(name, "is not supported by pdserve")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise InvalidRequestError("stream_options", "must be an object")
    sampling = sampling_from_body(body, chat)
    parsed = OpenAIRequest(
        generate_pb2.GenerateRequest(sampling=sampling),
        chat,
        stream=bool(_optional(body, "stream", "bool")),
        include_usage=bool(_optional(stream_options, "include_usage", "bool")),
        logprobs=sampling.HasField("logprobs"),
    )
    parsed.generate.request_id = parsed.request_id
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise InvalidRequestError("cache_salt", "must be a non-empty string")
    parsed.generate.cache_salt = salt or ""  # its length is checked with the rest of the request
    if chat:
        _set_messages(parsed.generate, body.get("messages"))
    else:
        _set_prompt(parsed.generate, body.get("prompt"))
    return parsed
