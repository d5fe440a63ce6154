"""The GenerateResponse messages of one request: streamed text deltas, and the final message
with finish_reason, usage and timings; and how a finished decode stream is read to its end."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Protocol, TypeVar

import grpc

from services.common.pb import common_pb2, generate_pb2
from services.router.flow.request_stats import RequestStats
from services.router.flow.text_stream import TextDelta, TextStream

logger = logging.getLogger(__name__)


def delta_response(
    delta: TextDelta, logprobs: Sequence[common_pb2.TokenLogprob], stats: RequestStats
) -> generate_pb2.GenerateResponse:
    """A streamed message; `logprobs` (empty unless asked for) are those of the tokens the
    worker sent, of which the accepted `delta.token_ids` are a prefix."""
    stats.on_tokens_sent(len(delta.token_ids))
    return generate_pb2.GenerateResponse(
        token_ids=delta.token_ids,
        text=delta.text,
        logprobs=list(logprobs)[: len(delta.token_ids)],
    )


def final_response(
    delta: TextDelta,
    text: TextStream,
    finish_reason: str,
    logprobs: Sequence[common_pb2.TokenLogprob],
    stats: RequestStats,
) -> generate_pb2.GenerateResponse:
    """The last message: remaining text (held-back text is released), usage, timings."""
    chunk = delta.text
    if not delta.stopped:
        tail, stopped = text.finish()
        chunk += tail
        finish_reason = "stop" if stopped else finish_reason
    if delta.token_ids:
        stats.on_tokens_sent(len(delta.token_ids))
    stats.on_finished(finish_reason)
    return generate_pb2.GenerateResponse(
        token_ids=delta.token_ids,
        text=chunk,
        finish_reason=finish_reason,
        usage=stats.usage(),
        timings=stats.timings(),
        logprobs=list(logprobs)[: len(delta.token_ids)],
    )


MessageT = TypeVar("MessageT", covariant=True)


class ResponseStream(Protocol[MessageT]):
    """A response-streaming gRPC call: an iterator over its messages that can be cancelled."""

    def __iter__(self) -> Iterator[MessageT]: ...

    def cancel(self) -> bool: ...


def drain(call: ResponseStream[object]) -> None:
    """Waits for the end of a decode stream whose last message was already received.

    A message after finish_reason is a worker bug: the call is cancelled instead of read on.
    An error status after finish_reason is logged, not raised: the client already has it all.
    """
    try:
        for _ in call:
            logger.warning("decode worker sent a message after finish_reason; cancelling it")
            call.cancel()
            return
    except grpc.RpcError as exc:
        logger.warning("decode stream failed after finish_reason: %s", exc)
