"""The Prefill and Decode RPCs as the request flow makes them: dataclasses in, dataclasses out.

The flow (`router/flow/`) never sees a protobuf message: it hands a `WorkerRequest` to
`start_prefill` / `start_decode`, and reads `PrefillReply` / `DecodeReply` back. The calls keep
gRPC's semantics: they carry the request id as metadata, `cancel()` cancels the call, a failed
call raises `grpc.RpcError` (a cancelled prefill's `result()` raises grpc.FutureCancelledError).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc

from services.common import request_id
from services.common.convert import (
    handle_from_proto,
    handle_to_proto,
    logprobs_from_proto,
    sampling_to_proto,
)
from services.common.pb import worker_pb2
from services.engine.outputs import TokenLogprobs
from services.engine.sampling_params import SamplingParams
from services.kv_transfer.handle import KVHandle
from services.router.pool.worker_pool import WorkerPool

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerRequest:
    """What a Prefill or Decode call says about one request."""

    request_id: str
    """The workers' id of this attempt (a migrated request gets a new one)."""
    prompt_token_ids: Sequence[int]
    sampling: SamplingParams
    cache_salt: str = ""
    """Part of every block hash ("": no salt)."""
    output_token_ids: Sequence[int] = ()
    """Tokens the client already has (a migrated request's): the worker goes on after them."""
    itl_objective_ms: float = 0.0
    """Decode only: the stream's ITL objective (0: the worker's default)."""
    tpot_objective_ms: float = 0.0
    """Decode only: the stream's mean-TPOT objective (0: the worker's default)."""
    ttft_objective_ms: float = 0.0
    """Decode on the local path only: the milliseconds left of the TTFT objective (0: none)."""


@dataclass(frozen=True)
class RemoteKV:
    """A request's prompt KV pinned on a prefill worker: the engine's handle, and the HOST:PORT
    of the KVTransfer service that serves it ("": the prefill worker that answered)."""

    handle: KVHandle
    source: str


@dataclass(frozen=True)
class PrefillReply:
    """A Prefill call's answer: the first token, and the pinned KV unless that token ended it."""

    first_token_id: int
    finish_reason: str
    """"stop" or "length" when the first token ends the request, else ""."""
    kv: RemoteKV | None
    first_logprob: TokenLogprobs | None
    num_cached_tokens: int
    """Prompt tokens the worker took from its prefix cache."""
    compute_seconds: float
    """The worker's compute: first scheduled -> first token sampled."""


@dataclass(frozen=True)
class DecodeReply:
    """One message of a Decode stream."""

    token_ids: tuple[int, ...]
    finish_reason: str
    """"" until the last message."""
    logprobs: tuple[TokenLogprobs, ...]
    kv_transfer_seconds: float
    """First message: seconds the worker spent pulling the prompt KV."""
    num_cached_tokens: int
    """First message: prompt tokens found in the worker's own prefix cache."""
    compute_seconds: float
    """The message with the worker's first sampled token: that step's compute, in seconds."""


class PrefillFuture:
    """A Prefill call in flight."""

    def __init__(self, future: grpc.Future) -> None:
        self._future = future

    def cancel(self) -> bool:
        return self._future.cancel()

    def result(self) -> PrefillReply:
        """Waits for the answer; raises grpc.RpcError, or grpc.FutureCancelledError."""
        reply = self._future.result()
        kv = None
        if reply.HasField("kv_handle"):
            kv = RemoteKV(*handle_from_proto(reply.kv_handle))
        first_logprob = None
        if reply.HasField("first_logprob"):
            first_logprob = logprobs_from_proto(reply.first_logprob)
        return PrefillReply(
            reply.first_token_id,
            reply.finish_reason,
            kv,
            first_logprob,
            reply.num_cached_tokens,
            reply.compute_seconds,
        )


class _ResponseStream(Protocol):
    """A response-streaming gRPC call: an iterator over its messages that can be cancelled."""

    def __iter__(self) -> Iterator[worker_pb2.DecodeResponse]: ...

    def cancel(self) -> bool: ...


class DecodeStream:
    """A Decode call in flight: iterate it for its replies."""

    def __init__(self, call: _ResponseStream) -> None:
        self._call = call

    def cancel(self) -> bool:
        return self._call.cancel()

    def __iter__(self) -> Iterator[DecodeReply]:
        for reply in self._call:
            yield DecodeReply(
                tuple(reply.token_ids),
                reply.finish_reason,
                tuple(logprobs_from_proto(lp) for lp in reply.logprobs),
                reply.kv_transfer_seconds,
                reply.num_cached_tokens,
                reply.compute_seconds,
            )

    def drain(self) -> None:
        """Waits for the end of a stream whose last message was already received.

        A message after finish_reason is a worker bug: the call is cancelled instead of read
        on. An error status after finish_reason is logged, not raised: the client has it all.
        """
        try:
            for _ in self._call:
                logger.warning("decode worker sent a message after finish_reason; cancelling it")
                self._call.cancel()
                return
        except grpc.RpcError as exc:
            logger.warning("decode stream failed after finish_reason: %s", exc)


def start_prefill(
    pool: WorkerPool, address: str, request: WorkerRequest, timeout: float
) -> PrefillFuture:
    """Sends the Prefill RPC to the worker at `address`; `timeout` in seconds."""
    message = worker_pb2.PrefillRequest(**_request_fields(request))
    future = pool.prefill_stub(address).Prefill.future(
        message, timeout=timeout, metadata=request_id.metadata()
    )
    return PrefillFuture(future)


def start_decode(
    pool: WorkerPool, address: str, request: WorkerRequest, kv: RemoteKV | None, timeout: float
) -> DecodeStream:
    """Opens the Decode stream on the worker at `address`: with `kv`, the worker pulls the
    prompt KV from its source; without, it prefills the prompt itself. `timeout` in seconds."""
    message = worker_pb2.DecodeRequest(
        **_request_fields(request),
        itl_objective_ms=request.itl_objective_ms,
        tpot_objective_ms=request.tpot_objective_ms,
        ttft_objective_ms=request.ttft_objective_ms if kv is None else 0.0,
    )
    if kv is not None:
        message.kv_handle.CopyFrom(handle_to_proto(kv.handle, kv.source))
    call = pool.decode_stub(address).Decode(
        message, timeout=timeout, metadata=request_id.metadata()
    )
    return DecodeStream(call)


def _request_fields(request: WorkerRequest) -> dict:
    return {
        "request_id": request.request_id,
        "prompt_token_ids": request.prompt_token_ids,
        "sampling": sampling_to_proto(request.sampling),
        "cache_salt": request.cache_salt,
        "output_token_ids": request.output_token_ids,
    }
