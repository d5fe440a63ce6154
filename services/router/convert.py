"""The public Generate API's messages <-> the request flow's dataclasses (`flow/messages.py`).

What `GenerationServicer` (`router/server.py`) converts on the way in and out; the sampling
fields go through `services.common.convert`, and are validated by `SamplingParams` itself.
"""

from __future__ import annotations

from dataclasses import asdict

from services.common.convert import logprobs_to_proto, sampling_from_proto
from services.common.pb import generate_pb2
from services.router.flow.messages import ChatMessage, GenerationOutput, GenerationRequest


def request_from_proto(msg: generate_pb2.GenerateRequest, request_id: str) -> GenerationRequest:
    """The flow's request for `msg`, under `request_id` (the call's settled id).

    Raises InvalidRequestError / ValueError naming the field: no prompt, a sampling value out
    of range, an empty stop string or cache_salt over its limit (proto3's empty salt is none).
    """
    kind = msg.WhichOneof("prompt")
    return GenerationRequest(
        text=msg.text if kind == "text" else None,
        token_ids=tuple(msg.token_ids.ids) if kind == "token_ids" else None,
        chat=tuple(ChatMessage(m.role, m.content) for m in msg.chat.messages)
        if kind == "chat"
        else None,
        sampling=sampling_from_proto(msg.sampling),
        stop=tuple(msg.sampling.stop),
        cache_salt=msg.cache_salt or None,
        request_id=request_id,
        itl_objective_ms=msg.itl_objective_ms or None,
        tpot_objective_ms=msg.tpot_objective_ms or None,
        ttft_objective_ms=msg.ttft_objective_ms or None,
    )


def output_to_proto(output: GenerationOutput) -> generate_pb2.GenerateResponse:
    """One streamed message; usage and timings only on the last (unset on the others)."""
    usage, timings = output.usage, output.timings
    return generate_pb2.GenerateResponse(
        token_ids=output.token_ids,
        text=output.text,
        finish_reason=output.finish_reason or "",
        usage=generate_pb2.Usage(**asdict(usage)) if usage is not None else None,
        timings=generate_pb2.Timings(**asdict(timings)) if timings is not None else None,
        logprobs=[logprobs_to_proto(lp) for lp in output.logprobs],
    )
