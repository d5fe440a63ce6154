"""OpenAI-compatible response bodies (completions and chat completions, streamed or not), errors and
the model list: the JSON shapes `router/openai/app.py` sends (requests:
`router/openai/protocol.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from services.engine.outputs import TokenLogprobs
from services.router.flow.messages import Usage
from services.router.openai.protocol import OpenAIRequest


def usage_body(usages: Sequence[Usage], n: int = 1) -> dict:
    """OpenAI's usage of a request whose choices had `usages` (n per prompt, in choice order):
    each prompt counted once, every choice's completion tokens."""
    prompts = usages[::n]
    prompt_tokens = sum(u.prompt_tokens for u in prompts)
    completion_tokens = sum(u.completion_tokens for u in usages)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": sum(u.cached_tokens for u in prompts)},
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
    entries: Sequence[TokenLogprobs],
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
                    "top_logprobs": [_chat_token(token_text(t), lp) for t, lp in e.top],
                }
                for e in entries
            ]
        }
    return {
        "tokens": [token_text(e.token_id) for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{token_text(t): lp for t, lp in e.top} for e in entries],
        "text_offset": list(text_offsets),
    }


def _chat_token(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


def choice_body(
    req: OpenAIRequest, index: int, text: str, finish_reason: str, logprobs: dict | None = None
) -> dict:
    """One choice of the non-streaming reply; `logprobs` as `logprobs_body` renders them."""
    if req.chat:
        message = {"role": "assistant", "content": text}
        return {
            "index": index,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def response_body(
    req: OpenAIRequest, model: str, choices: list[dict], usages: Sequence[Usage]
) -> dict:
    """The non-streaming reply: `choices` from `choice_body`, in index order."""
    usage = usage_body(usages, req.n)
    return {**_envelope(req, model, chunk=False), "choices": choices, "usage": usage}


def chunk_body(
    req: OpenAIRequest,
    model: str,
    index: int,
    text: str,
    finish_reason: str | None,
    first: bool,
    logprobs: dict | None = None,
) -> dict:
    """One streamed (SSE) chunk of choice `index`; a chat choice's first chunk also carries the
    assistant role."""
    if req.chat:
        delta: dict[str, str] = {"role": "assistant"} if first else {}
        if text or not first:
            delta["content"] = text
        choice = {
            "index": index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
    else:
        choice = {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
    return {**_envelope(req, model, chunk=True), "choices": [choice]}


def usage_chunk_body(req: OpenAIRequest, model: str, usages: Sequence[Usage]) -> dict:
    """The extra last chunk sent when stream_options.include_usage is set (choices empty)."""
    usage = usage_body(usages, req.n)
    return {**_envelope(req, model, chunk=True), "choices": [], "usage": usage}


def error_body(message: str, kind: str, code: int, param: str | None = None) -> dict:
    """OpenAI's error object; `param` names the offending request field, when known."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def model_card(model: str, max_model_len: int) -> dict:
    """One entry of /v1/models (and the body of /v1/models/{model})."""
    return {
        "id": model,
        "object": "model",
        "created": 0,
        "owned_by": "pdserve",
        "max_model_len": max_model_len,
    }


def models_body(model: str, max_model_len: int) -> dict:
    return {"object": "list", "data": [model_card(model, max_model_len)]}
