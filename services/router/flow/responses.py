"""The outputs of one request: streamed text deltas, and the final output with finish_reason,
usage and timings (`GenerationOutput`, `messages.py`)."""

from __future__ import annotations

from collections.abc import Sequence

from services.engine.outputs import TokenLogprobs
from services.router.flow.messages import GenerationOutput
from services.router.flow.request_stats import RequestStats
from services.router.flow.text_stream import TextDelta, TextStream


def delta_output(
    delta: TextDelta, logprobs: Sequence[TokenLogprobs], stats: RequestStats
) -> GenerationOutput:
    """A streamed output; `logprobs` (empty unless asked for) are those of the tokens the
    worker sent, of which the accepted `delta.token_ids` are a prefix."""
    stats.on_tokens_sent(len(delta.token_ids))
    return GenerationOutput(
        tuple(delta.token_ids), delta.text, tuple(logprobs[: len(delta.token_ids)])
    )


def final_output(
    delta: TextDelta,
    text: TextStream,
    finish_reason: str,
    logprobs: Sequence[TokenLogprobs],
    stats: RequestStats,
) -> GenerationOutput:
    """The last output: remaining text (held-back text is released), usage, timings."""
    chunk = delta.text
    if not delta.stopped:
        tail, stopped = text.finish()
        chunk += tail
        finish_reason = "stop" if stopped else finish_reason
    if delta.token_ids:
        stats.on_tokens_sent(len(delta.token_ids))
    stats.on_finished(finish_reason)
    return GenerationOutput(
        tuple(delta.token_ids),
        chunk,
        tuple(logprobs[: len(delta.token_ids)]),
        finish_reason,
        stats.usage(),
        stats.timings(),
    )
