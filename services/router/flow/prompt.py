"""Turning a `GenerationRequest` into prompt token ids checked against the served model.

The router validates everything a worker would reject, so a bad request fails before it costs
a prefill: typed errors (InvalidRequestError, ValueError) name the offending field. Nothing is
clamped silently. The sampling values were checked when the request's `SamplingParams` was built
(`services/engine/sampling_params.py`, the one place); here is what depends on the model: the
vocabulary, max_model_len and the tokenizer.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from services.engine.errors import InvalidRequestError
from services.engine.loader import model_limits, resolve_model
from services.engine.sampling_params import SamplingParams
from services.engine.tokenizer import Tokenizer
from services.engine.validation import check_sampling_ids, check_token_ids
from services.router.flow.messages import ChatMessage, GenerationRequest

logger = logging.getLogger(__name__)
CHAT_ROLES = ("system", "developer", "user", "assistant")
MAX_MESSAGES = 2048  # in one chat: each renders to tokens, and rendering costs per message


@dataclass(frozen=True)
class ModelInfo:
    """What the router needs to know about the served model."""

    name: str
    """The --model value as given (reported by the HTTP API)."""
    path: Path
    """The resolved local Hugging Face folder."""
    vocab_size: int
    """Valid token ids are [0, vocab_size)."""
    max_model_len: int
    """Longest prompt + output in tokens; a prompt must be shorter."""
    tokenizer: Tokenizer | None
    """None for a folder without a tokenizer (then only token-id prompts work, text is empty)."""

    @classmethod
    def load(cls, model: str, max_model_len: int | None = None) -> ModelInfo:
        """Reads config.json and the tokenizer (`services.engine.tokenizer`: Hugging Face
        `tokenizers`, no torch) from `resolve_model(model)`.

        Raises ValueError (naming `model` or `max_model_len`) for an unknown model or a
        max_model_len beyond the model's positions; RuntimeError if the default model is missing.
        """
        path = resolve_model(model)
        vocab_size, limit = model_limits(path, max_model_len)
        tokenizer = Tokenizer.load(path)
        if tokenizer is None:
            logger.warning("model %s has no tokenizer: only token-id prompts are accepted", path)
        else:
            tokenizer.prepare_chat_template()
            _ = tokenizer.max_bytes_per_token  # computed now, not by the first request
        return cls(model, path, vocab_size, limit, tokenizer)

    def check_text_length(self, num_chars: int, field: str) -> None:
        """InvalidRequestError naming `field` when a text of `num_chars` characters must have
        at least max_model_len tokens (checked in constant time, before tokenizing)."""
        per_token = self.tokenizer.max_bytes_per_token if self.tokenizer else None
        if per_token and num_chars // per_token >= self.max_model_len:
            raise InvalidRequestError(
                field,
                f"{num_chars} characters are at least {num_chars // per_token} tokens; "
                f"a prompt must be shorter than max_model_len {self.max_model_len} tokens",
            )


@dataclass(frozen=True)
class PreparedRequest:
    """A validated request, ready for the workers."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stop: tuple[str, ...]
    """Stop strings (applied by the router to the text, never sent to workers)."""
    cache_salt: str = ""
    """Sent to both workers: part of every block hash (empty: no salt)."""
    itl_objective_ms: float = 0.0
    """Sent to the decode worker: this stream's ITL objective (0: the worker's default)."""
    tpot_objective_ms: float = 0.0
    """Sent to the decode worker: this stream's mean-TPOT objective (0: the worker's default)."""
    ttft_objective_ms: float | None = None
    """The TTFT objective its serving path is chosen for (None: the router's default); on the
    local path the decode worker is sent what is left of it (`ttft_left_ms`)."""

    def path_objectives(self) -> tuple[float | None, float, float]:
        """Its TTFT, ITL and TPOT objectives (milliseconds) as `FlowContext.choose_path` takes
        them."""
        return self.ttft_objective_ms, self.itl_objective_ms, self.tpot_objective_ms

    def ttft_left_ms(self, since: float, default_ms: float | None, local: bool) -> float:
        """What is left of its TTFT objective (else `default_ms`, the router's) at this moment,
        counted from `since` (time.monotonic seconds: its path's choice), for the decode worker
        prefilling it (`local`) to meet (milliseconds); 0.0 (none) on the remote path, without
        an objective, or once it has passed."""
        objective = self.ttft_objective_ms or default_ms
        if not local or not objective:
            return 0.0
        return max(objective - (time.monotonic() - since) * 1000, 0.0)


def prepare_request(request: GenerationRequest, model: ModelInfo) -> PreparedRequest:
    """Checks `request` against `model` and tokenizes its prompt.

    Raises:
        InvalidRequestError: field "max_tokens" (no room for a prompt, or none left by this
            one), "prompt" (empty, too long for max_model_len, text without a tokenizer),
            "prompt_token_ids" / "stop_token_ids" / "logit_bias" (ids outside [0, vocab_size)),
            "chat.messages[i].role", "stop" (no tokenizer to match text with).
    """
    params = request.sampling
    if params.max_tokens >= model.max_model_len:  # before tokenizing: no prompt could fit it
        raise InvalidRequestError(
            "max_tokens",
            f"must be below max_model_len {model.max_model_len} (room for the prompt), "
            f"got {params.max_tokens}",
        )
    if request.stop and model.tokenizer is None:
        raise InvalidRequestError("stop", "this model has no tokenizer, so no text to match")
    check_sampling_ids(params, model.vocab_size)
    prompt_ids = tokenize_prompt(request, model)
    if not prompt_ids:
        raise InvalidRequestError("prompt", "must not be empty")
    if len(prompt_ids) >= model.max_model_len:
        raise InvalidRequestError(
            "prompt",
            f"{len(prompt_ids)} tokens; must be shorter than max_model_len {model.max_model_len}",
        )
    check_token_ids(prompt_ids, model.vocab_size, "prompt_token_ids")
    if len(prompt_ids) + params.max_tokens > model.max_model_len:  # 400 up front, as vLLM
        raise InvalidRequestError(
            "max_tokens",
            f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
            f"max_model_len {model.max_model_len}",
        )
    # Workers key requests (and KV handles) by id: a client's own id gets a unique suffix so two
    # clients reusing one id can never collide.
    request_id = (
        f"{request.request_id}-{uuid.uuid4().hex[:12]}" if request.request_id else uuid.uuid4().hex
    )
    return PreparedRequest(
        request_id, prompt_ids, params, request.stop, request.cache_salt or "",
        request.itl_objective_ms or 0.0, request.tpot_objective_ms or 0.0,
        request.ttft_objective_ms,
    )  # fmt: skip


def tokenize_prompt(request: GenerationRequest, model: ModelInfo) -> list[int]:
    """Prompt token ids of the request's text, token ids or chat (InvalidRequestError)."""
    if request.token_ids is not None:
        return list(request.token_ids)
    tokenizer = model.tokenizer
    if tokenizer is None:
        raise InvalidRequestError("prompt", "this model has no tokenizer; send token_ids")
    if request.text is not None:
        model.check_text_length(len(request.text), "prompt")
        return tokenizer.encode(request.text) if request.text else []
    assert request.chat is not None  # GenerationRequest holds exactly one prompt
    messages = chat_messages(request.chat)
    model.check_text_length(sum(len(m["content"]) for m in messages), "messages")
    if not tokenizer.has_chat_template:
        raise InvalidRequestError("chat", "this model's tokenizer has no chat template")
    return tokenizer.encode(tokenizer.apply_chat_template(messages))


def chat_messages(chat: tuple[ChatMessage, ...]) -> list[dict[str, str]]:
    """The chat as template input (a "developer" message as "system"); InvalidRequestError for
    no messages or an unknown role."""
    if not chat:
        raise InvalidRequestError("prompt", "chat has no messages")
    if len(chat) > MAX_MESSAGES:
        raise InvalidRequestError("chat.messages", f"at most {MAX_MESSAGES} messages")
    for i, message in enumerate(chat):
        if message.role not in CHAT_ROLES:
            raise InvalidRequestError(
                f"chat.messages[{i}].role",
                f"expected one of {', '.join(CHAT_ROLES)}, got {message.role!r}",
            )
    # OpenAI's "developer" messages replace "system" ones; chat templates know only "system".
    return [
        {"role": "system" if m.role == "developer" else m.role, "content": m.content} for m in chat
    ]
