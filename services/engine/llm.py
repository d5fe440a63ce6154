"""`LLM`: an in-process engine that runs prompts to completion (vLLM's offline `LLM` API).

The `Engine` has three verbs (add_request / step / abort) and serves every role; this wrapper
adds what a script or `pdserve run` wants on top of a BOTH engine: `generate` (a batch of
prompts to completion, outputs in prompt order) and `stream` (one prompt, text deltas as they
are decoded, UTF-8 safe).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from services.engine.config import EngineConfig, EngineRole
from services.engine.detokenizer import IncrementalDetokenizer
from services.engine.engine import Engine
from services.engine.errors import InvalidRequestError
from services.engine.outputs import CompletionOutput, RequestOutput
from services.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class StreamDelta:
    """One step of `LLM.stream`: the engine's output and the text it completes."""

    output: RequestOutput
    text: str  # append-only; "" while a multi-byte character is incomplete


class LLM:
    """A BOTH-role engine driven to completion. `LLM(EngineConfig(...))`, or `LLM(engine)` to
    wrap an engine built elsewhere (tests). Raises ValueError (naming the field) for a bad
    config, InvalidRequestError for an engine in another role."""

    def __init__(self, engine: Engine | EngineConfig | None = None) -> None:
        self.engine = engine if isinstance(engine, Engine) else Engine(engine or EngineConfig())
        if self.engine.config.role != EngineRole.BOTH:
            role = self.engine.config.role.name
            raise InvalidRequestError("role", f"LLM needs a BOTH engine, not {role}")

    @property
    def tokenizer(self):  # noqa: ANN201 - services.engine.tokenizer.Tokenizer | None
        return self.engine.tokenizer

    def chat_prompt(self, message: str) -> str:
        """One user message as prompt text, through the model's chat template."""
        if self.engine.tokenizer is None:
            raise InvalidRequestError("chat", "the model folder has no tokenizer")
        messages = [{"role": "user", "content": message}]
        return self.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    def generate(
        self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[CompletionOutput]:
        """Run prompts to completion (BOTH role); outputs in prompt order."""
        if self.engine.has_unfinished_requests():
            raise InvalidRequestError(
                "generate", "the engine has requests in flight; drive them with step()"
            )
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise InvalidRequestError(
                "sampling_params", f"{len(params_list)} for {len(prompts)} prompts"
            )
        ids: list[str] = []
        try:
            for prompt, sp in zip(prompts, params_list, strict=True):
                ids.append(self.engine.add_request(prompt, sp))
        except Exception:
            for request_id in ids:  # all or nothing: a bad prompt leaves no request behind
                self.engine.abort(request_id)
            raise
        prompt_ids = {rid: list(self.engine.requests[rid].prompt_token_ids) for rid in ids}
        done: dict[str, RequestOutput] = {}
        logprobs: dict[str, list] = {rid: [] for rid in ids}
        while len(done) < len(ids):
            for out in self.engine.step():
                if out.request_id in prompt_ids:
                    logprobs[out.request_id].extend(out.new_logprobs)
                    if out.finished:
                        done[out.request_id] = out
        return [
            CompletionOutput(
                rid,
                prompt_ids[rid],
                done[rid].output_token_ids,
                self.text(prompt_ids[rid], done[rid].output_token_ids),
                done[rid].finish_reason or "",
                tuple(logprobs[rid]),
                done[rid].num_cached_tokens,
            )
            for rid in ids
        ]

    def text(self, prompt_ids: list[int], token_ids: list[int]) -> str | None:
        """The text of generated `token_ids` after `prompt_ids` (as streamed: no space
        clean-up); None without a tokenizer."""
        if self.engine.tokenizer is None:
            return None
        detok = IncrementalDetokenizer(self.engine.tokenizer, prompt_ids)
        return detok.add_tokens(token_ids) + detok.flush()

    def stream(self, prompt: str | list[int], params: SamplingParams) -> Iterator[StreamDelta]:
        """Run one prompt, yielding each step's output with the text it completes (the last
        delta flushes whatever the detokenizer held back). Raises as `Engine.add_request`."""
        if self.engine.has_unfinished_requests():
            raise InvalidRequestError("stream", "the engine has requests in flight")
        request_id = self.engine.add_request(prompt, params)
        prompt_ids = list(self.engine.requests[request_id].prompt_token_ids)
        tokenizer = self.engine.tokenizer
        detok = IncrementalDetokenizer(tokenizer, prompt_ids) if tokenizer is not None else None
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.request_id != request_id:
                    continue
                text = ""
                if detok is not None:
                    text = detok.add_tokens(out.new_token_ids) + (
                        detok.flush() if out.finished else ""
                    )
                yield StreamDelta(out, text)

    def prompt_token_ids(self, prompt: str | list[int]) -> list[int]:
        """The ids a prompt runs as (text through the tokenizer, without special tokens)."""
        return self.engine.checker.prompt_ids(prompt)
