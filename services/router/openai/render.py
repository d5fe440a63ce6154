"""One choice's flow outputs (`GenerationOutput`) rendered as OpenAI JSON: SSE chunks, or a
whole choice.

Runs on the choice's flow thread (`router/openai/threads.py`), not the event loop: log-probabilities
need the tokenizer (each token's text, and where it starts in the completion), and the
tokenizer's lock must never stall the loop that serves every other stream.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import asdict, dataclass

from services.common.errors import ShuttingDownError
from services.engine.tokenizer import Tokenizer
from services.router.flow.messages import GenerationOutput, Usage
from services.router.openai import bodies
from services.router.openai import protocol as oai
from services.router.openai.errors import http_error
from services.router.openai.protocol import OpenAIRequest


def sse_event(body: dict | str) -> bytes:
    """One server-sent event: `data: {json}\\n\\n` (or `data: [DONE]\\n\\n`)."""
    data = body if isinstance(body, str) else json.dumps(body, ensure_ascii=False)
    return b"data: " + data.encode() + b"\n\n"


@dataclass(frozen=True)
class ChoiceEnd:
    """The last item of a streamed choice: its usage (for the usage chunk)."""

    usage: Usage


@dataclass
class ChoiceRenderer:
    """Renders choice `index` of `req` (`echo_text`: the prompt's text when echo is set)."""

    req: OpenAIRequest
    model_name: str
    index: int
    tokenizer: Tokenizer | None
    echo_text: str = ""

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else ""

    def text_offsets(self, token_ids: list[int], first: int, text_len: int) -> list[int]:
        """Where tokens first.. of the completion `token_ids` start in its text: the length of
        the text of the tokens before each (a character split across tokens starts at the
        first of them); capped at the text sent, which a stop string may have cut."""
        if self.tokenizer is None:
            return [0] * (len(token_ids) - first)
        return [
            min(len(self.tokenizer.decode(token_ids[:i]).rstrip("\ufffd")), text_len)
            for i in range(first, len(token_ids))
        ]

    def complete(self, messages: list[GenerationOutput]) -> tuple[dict, Usage]:
        """The whole choice (non-streaming) and its usage."""
        last = messages[-1]
        assert last.finish_reason and last.usage and last.timings  # the last output's
        text = "".join(m.text for m in messages)
        entries = [lp for m in messages for lp in m.logprobs]
        offsets = self.text_offsets([lp.token_id for lp in entries], 0, len(text))
        logprobs = bodies.logprobs_body(self.req, entries, self.token_text, offsets)
        choice = bodies.choice_body(
            self.req, self.index, self.echo_text + text, last.finish_reason, logprobs
        )
        choice["timings"] = asdict(last.timings)  # pdserve's: where the time went
        return choice, last.usage

    def whole(self, messages: Iterator[GenerationOutput]) -> Iterator[tuple[dict, Usage]]:
        """`complete` of all of `messages`, as the one item of a flow thread's iterator."""
        yield self.complete(list(messages))

    def chunks(self, messages: Iterator[GenerationOutput]) -> Iterator[bytes | ChoiceEnd]:
        """SSE events of the choice, then its `ChoiceEnd`; reads `messages` to their end."""
        token_ids: list[int] = []  # every token streamed so far, for logprobs' text offsets
        text_len, first = 0, True
        for message in messages:
            finish = message.finish_reason
            first_new = len(token_ids)
            token_ids += [lp.token_id for lp in message.logprobs]
            text_len += len(message.text)
            if message.text or finish or first or (self.req.logprobs and message.logprobs):
                logprobs = None
                if self.req.logprobs:
                    offsets = self.text_offsets(token_ids, first_new, text_len)
                    logprobs = bodies.logprobs_body(
                        self.req, message.logprobs, self.token_text, offsets
                    )
                text = (self.echo_text if first else "") + message.text
                body = bodies.chunk_body(
                    self.req, self.model_name, self.index, text, finish, first, logprobs
                )
                if message.timings is not None:  # the last chunk: where the choice's time went
                    body["choices"][0]["timings"] = asdict(message.timings)
                yield sse_event(body)
                first = False
            if message.usage is not None:
                yield ChoiceEnd(message.usage)


async def sse_body(
    parsed: oai.OpenAIRequest,
    model: str,
    head: list[tuple[int, bytes | ChoiceEnd]],
    events: AsyncIterator[tuple[int, bytes | ChoiceEnd]],
    on_end: Callable[[], None],
    stopping: Callable[[], bool] = lambda: False,
) -> AsyncIterator[bytes]:
    """The event stream: the chunks already read, the rest as they come, the usage chunk when
    asked for, `[DONE]`. An error after the 200 is reported in-band, then `[DONE]`. `on_end`
    runs however the stream ends (client gone included); `stopping()` says the router is shutting
    down, so an error is reported as that."""
    usages: dict[int, Usage] = {}
    try:
        async for index, item in _chain(head, events):
            if isinstance(item, ChoiceEnd):
                usages[index] = item.usage
            else:
                yield item
        if parsed.include_usage:
            ordered = [usages[i] for i in sorted(usages)]
            yield sse_event(bodies.usage_chunk_body(parsed, model, ordered))
    except Exception as exc:  # noqa: BLE001 - headers are out; report in-band
        yield sse_event(http_error(ShuttingDownError() if stopping() else exc)[1])
    finally:
        on_end()
    yield sse_event("[DONE]")


async def _chain(head: list, rest: AsyncIterator) -> AsyncIterator:
    for item in head:
        yield item
    async for item in rest:
        yield item
