"""OpenAI-compatible request parsing (completions and chat completions).

Only the JSON shapes live here (responses: `router/openai/bodies.py`; sampling fields:
`router/openai/sampling.py`); `router/openai/app.py` serves them and `generate.py` runs each
sequence. Request fields: model (must be the served one: 404 otherwise; absent means it), prompt
(completions: a string, a list of token ids, or a list of either, each its own prompt) / messages
(chat: roles system, developer, user, assistant; content a string or a list of text parts), n
(1..max_n sequences per prompt; choice i of prompt p has index p * n + i, and with a seed it
samples with seed + i, as vLLM's parallel sampling), echo (completions: the prompt's text before
each choice's), stream, stream_options.include_usage, cache_salt (extension, as in vLLM: requests
share cached prefixes only with the same salt), and the sampling fields. What OpenAI defines and
pdserve does not do is refused by name when asked for with a value that would change the answer
(best_of other than n, suffix, tools, tool_choice other than "none" / "auto", response_format other
than {"type": "text"}, functions); the no-op values are accepted. Other unknown fields are ignored,
as OpenAI-compatible servers do. Defaults are the engine's (max_tokens 16, temperature 1.0).
"""

from __future__ import annotations

import dataclasses
import math
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from services.engine.errors import InvalidRequestError
from services.engine.sampling_params import UINT64_MAX, is_int
from services.router.flow.messages import ChatMessage, GenerationRequest
from services.router.flow.prompt import CHAT_ROLES, MAX_MESSAGES
from services.router.openai.sampling import (
    checked_text,
    optional,
    sampling_from_body,
    stop_strings,
)

MAX_PROMPTS = 256  # prompts in one completions request
_NO_OP = {"tool_choice": ("none", "auto"), "response_format": ({"type": "text"},)}


@dataclass(frozen=True)
class OpenAIRequest:
    """A parsed request: the flow's request of each prompt, and how to shape the reply."""

    prompts: tuple[GenerationRequest, ...]
    chat: bool
    stream: bool
    include_usage: bool
    n: int = 1
    echo: bool = False
    logprobs: bool = False  # render log-probabilities in the reply
    model: str | None = None  # as the client named it (None: not named)
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def response_id(self) -> str:
        return ("chatcmpl-" if self.chat else "cmpl-") + self.request_id

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n

    def choice_requests(self) -> list[GenerationRequest]:
        """The flow's request of every choice, in choice-index order (p * n + i); choice i
        of a seeded request samples with seed + i."""
        out = []
        for p, prompt in enumerate(self.prompts):
            for i in range(self.n):
                sampling, seed = prompt.sampling, prompt.sampling.seed
                if i and seed is not None:
                    sampling = dataclasses.replace(sampling, seed=(seed + i) % (UINT64_MAX + 1))
                request_id = f"{self.request_id}-{p * self.n + i}"
                out.append(dataclasses.replace(prompt, sampling=sampling, request_id=request_id))
        return out


OBJECTIVE_HEADERS = {
    "x-slo-ttft-ms": "ttft_objective_ms",
    "x-slo-itl-ms": "itl_objective_ms",
    "x-slo-tpot-ms": "tpot_objective_ms",
}
"""Per-request objectives (milliseconds), as llm-d's x-slo-ttft-ms / x-slo-tpot-ms headers
(and x-slo-itl-ms), and the `GenerationRequest` field each sets."""


def with_objectives(parsed: OpenAIRequest, headers: Mapping[str, str]) -> OpenAIRequest:
    """`parsed` with the per-request objectives its headers set (`OBJECTIVE_HEADERS`: the TTFT,
    ITL and mean-TPOT objectives in milliseconds, for every choice). InvalidRequestError naming
    the header."""
    values: dict[str, Any] = {}
    for header, name in OBJECTIVE_HEADERS.items():
        text = headers.get(header)
        if text is None:
            continue
        try:
            values[name] = float(text)
        except ValueError:
            values[name] = math.nan
        if not 0 < values[name] < math.inf:
            raise InvalidRequestError(
                header, f"must be a number of milliseconds > 0, got {text[:40]!r}"
            )
    if not values:
        return parsed
    prompts = tuple(dataclasses.replace(p, **values) for p in parsed.prompts)
    return dataclasses.replace(parsed, prompts=prompts)


def _refuse_unsupported(body: dict, chat: bool, n: int) -> None:
    """Fields OpenAI defines that pdserve does not do, refused by name when they matter."""
    best_of = optional(body, "best_of", "int")
    if best_of is not None and best_of != n:
        raise InvalidRequestError("best_of", "is not supported (only best_of equal to n)")
    for name in ("suffix", "tools", "functions", "function_call"):
        if body.get(name):  # absent, null, false, [] and "" all mean "not asked for"
            raise InvalidRequestError(name, "is not supported by pdserve")
    for name, no_ops in _NO_OP.items():
        if body.get(name) is not None and body[name] not in no_ops:
            raise InvalidRequestError(
                name, f"is not supported by pdserve (only {' or '.join(map(repr, no_ops))})"
            )
    if body.get("echo") and chat:
        raise InvalidRequestError("echo", "is a completions field")


def _prompts(prompt: Any) -> list[str | list[int]]:
    """Completions `prompt`: a string, token ids, or a non-empty list of either."""
    if isinstance(prompt, str) or _is_token_ids(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and len(prompt) <= MAX_PROMPTS:
        if all(isinstance(p, str) or _is_token_ids(p) for p in prompt):
            return prompt
    raise InvalidRequestError(
        "prompt",
        f"must be a string, a list of token ids, or a list of at most {MAX_PROMPTS} of either",
    )


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(is_int(t) for t in value)


def _prompt_fields(prompt: str | list[int], field: str) -> dict[str, Any]:
    """The GenerationRequest fields of one completions prompt."""
    if isinstance(prompt, str):
        return {"text": checked_text(prompt, field)}
    return {"token_ids": tuple(prompt)}


def _message_content(message: Any, i: int) -> str:
    if not isinstance(message, dict):
        raise InvalidRequestError(f"messages[{i}]", "must be an object with a role")
    if message.get("role") not in CHAT_ROLES:
        raise InvalidRequestError(
            f"messages[{i}].role",
            f"expected one of {', '.join(CHAT_ROLES)}, got {message.get('role')!r:.40}",
        )
    content = message.get("content")
    if content is None and message["role"] == "assistant":
        return ""
    if isinstance(content, str):
        return checked_text(content, f"messages[{i}].content")
    if not isinstance(content, list):
        raise InvalidRequestError(
            f"messages[{i}].content", "must be a string or a list of text parts"
        )
    texts = []
    for j, part in enumerate(content):
        where = f"messages[{i}].content[{j}]"
        if not isinstance(part, dict) or part.get("type") != "text":
            raise InvalidRequestError(where, 'must be a {"type": "text", "text": ...} part')
        texts.append(checked_text(part.get("text"), f"{where}.text"))
    return "".join(texts)


def _include_usage(options: Any, stream: bool) -> bool:
    """`stream_options.include_usage`; stream_options only with `stream: true`, as OpenAI."""
    if options is None:
        return False
    if not isinstance(options, dict):
        raise InvalidRequestError("stream_options", "must be an object")
    if not stream:
        raise InvalidRequestError("stream_options", 'is only allowed with "stream": true')
    value = options.get("include_usage")
    if value is not None and not isinstance(value, bool):
        raise InvalidRequestError(
            "stream_options.include_usage", f"must be true or false, got {value!r:.40}"
        )
    return bool(value)


def _chat(messages: Any) -> tuple[ChatMessage, ...]:
    if not isinstance(messages, list) or not messages or len(messages) > MAX_MESSAGES:
        raise InvalidRequestError(
            "messages", f"must be a non-empty list of at most {MAX_MESSAGES} messages"
        )
    return tuple(_message(message, i) for i, message in enumerate(messages))


def _message(message: Any, i: int) -> ChatMessage:
    content = _message_content(message, i)  # checks first: an object, with a known role
    return ChatMessage(message["role"], content)


def parse_request(body: Any, chat: bool, max_n: int = 16) -> OpenAIRequest:
    """Builds the flow's requests; InvalidRequestError (or ValueError) names the offending
    field."""
    if not isinstance(body, dict):
        raise InvalidRequestError("body", "must be a JSON object")
    n = optional(body, "n", "int", 1, max_n)
    n = 1 if n is None else n
    _refuse_unsupported(body, chat, n)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidRequestError("model", "must be a string")
    stream = bool(optional(body, "stream", "bool"))
    include_usage = _include_usage(body.get("stream_options"), stream)
    sampling = sampling_from_body(body, chat)
    stop, salt = stop_strings(body), body.get("cache_salt")
    salt = None if salt is None else checked_text(salt, "cache_salt")

    def request(**prompt: Any) -> GenerationRequest:
        return GenerationRequest(**prompt, sampling=sampling, stop=stop, cache_salt=salt)

    if chat:
        prompts = [request(chat=_chat(body.get("messages")))]
    else:
        items = _prompts(body.get("prompt"))
        where = ["prompt"] if len(items) == 1 else [f"prompt[{p}]" for p in range(len(items))]
        prompts = [
            request(**_prompt_fields(item, field)) for item, field in zip(items, where, strict=True)
        ]
    echo = bool(optional(body, "echo", "bool"))
    if echo and sampling.logprobs is not None:
        raise InvalidRequestError("echo", "with logprobs is not supported (no prompt logprobs)")
    return OpenAIRequest(
        tuple(prompts),
        chat,
        stream=stream,
        include_usage=include_usage,
        n=n,
        echo=echo,
        logprobs=sampling.logprobs is not None,
        model=model,
    )
