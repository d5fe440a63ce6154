"""OpenAI-compatible response bodies (completions and chat completions, streamed or not),
errors and the model list: the JSON shapes `http_api.py` sends (requests: `openai_protocol.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from services.common.pb import common_pb2, generate_pb2
from services.router.openai_protocol import OpenAIRequest


def usage_body(usage: generate_pb2.Usage) -> dict:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def _envelope(req: OpenAIRequest, model: str, chunk: bool) -> dict:
    kind = "chat.completion" if req.chat else "text_completion"
    return {
        "id": req.response_id,
        "object": kind + (".chunk" if chunk and req.chat else ""),
        "created": req.created,
        "model": model,
    }


TokenText = Callable[[int], str]


def logprobs_body(
    req: OpenAIRequest,
    entries: Sequence[common_pb2.TokenLogprob],
    token_text: TokenText,
    text_offsets: Sequence[int] = (),
) -> dict | None:
    """OpenAI's `logprobs` object for these tokens (None when not asked for). Completions:
    tokens / token_logprobs / top_logprobs / text_offset (where each token's text starts in the
    completion, `text_offsets`); chat: content = [{token, logprob, bytes, top_logprobs}]."""
    if not req.logprobs:
        return None
    if req.chat:
        return {
            "content": [
                {
                    **_chat_token(token_text(e.token_id), e.logprob),
                    "top_logprobs": [_chat_token(token_text(t.token_id), t.logprob) for t in e.top],
                }
                for e in entries
            ]
        }
    return {
        "tokens": [token_text(e.token_id) for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{token_text(t.token_id): t.logprob for t in e.top} for e in entries],
        "text_offset": list(text_offsets),
    }


def _chat_token(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


def response_body(
    req: OpenAIRequest,
    model: str,
    text: str,
    finish_reason: str,
    usage: generate_pb2.Usage,
    logprobs: dict | None = None,
) -> dict:
    """The non-streaming reply; `logprobs` as `logprobs_body` renders them."""
    if req.chat:
        message = {"role": "assistant", "content": text}
        choice = {
            "index": 0,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
    else:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    return {**_envelope(req, model, chunk=False), "choices": [choice], "usage": usage_body(usage)}


def chunk_body(
    req: OpenAIRequest,
    model: str,
    text: str,
    finish_reason: str | None,
    first: bool,
    logprobs: dict | None = None,
) -> dict:
    """One streamed (SSE) chunk; the chat's first chunk also carries the assistant role."""
    if req.chat:
        delta: dict[str, str] = {"role": "assistant"} if first else {}
        if text or not first:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    return {**_envelope(req, model, chunk=True), "choices": [choice]}


def usage_chunk_body(req: OpenAIRequest, model: str, usage: generate_pb2.Usage) -> dict:
    """The extra last chunk sent when stream_options.include_usage is set (choices empty)."""
    return {**_envelope(req, model, chunk=True), "choices": [], "usage": usage_body(usage)}


def error_body(message: str, kind: str, code: int, param: str | None = None) -> dict:
    """OpenAI's error object; `param` names the offending request field, when known."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def models_body(model: str, max_model_len: int) -> dict:
    return {
        "object": "list",
        "data": [
            {
                "id": model,
                "object": "model",
                "created": 0,
                "owned_by": "pdserve",
                "max_model_len": max_model_len,
            }
        ],
    }
