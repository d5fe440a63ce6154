"""The router's request flow: validate -> Prefill -> first token -> Decode stream -> text.

Transport-light: `GenerateFlow.generate` takes a `GenerateRequest`, an absolute deadline and a
`CancelScope`, and yields `GenerateResponse` messages. The gRPC servicer and the HTTP API both
drive it; neither re-implements any step.

Every downstream call gets `timeout=` the time left until the deadline, so nothing waits
unbounded. Errors propagate as they are (a downstream `grpc.RpcError` keeps its code; typed
errors are mapped by `services.common.errors.ErrorInterceptor`). Freeing work downstream:
- a cancel (client gone, deadline) or a stop-string hit cancels the in-flight call, so the
  decode worker frees the request's blocks;
- if the request ends after the prefill pinned its KV but before a decode worker reported the
  KV landed (client gone, stop string in the first token, Decode failed or was never started),
  the router calls `KVTransfer.ReleaseKV` on the prefill worker named in the handle.
- if the prefill worker holding the KV dies (or loses it) before the KV landed, the decode
  worker says so (UNAVAILABLE naming that worker in `pdserve-failed-peer`) and the router
  prefills once more on another healthy prefill worker, keeping the first token the client
  already has; with no other worker the client gets UNAVAILABLE.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Generator, Iterator, Sequence
from typing import Protocol

import grpc

from services.common.channels import release_kv
from services.common.config import RouterConfig
from services.common.convert import sampling_to_proto
from services.common.errors import (
    PeerUnavailableError,
    ServiceUnavailableError,
    failed_peer,
    status_for,
)
from services.common.pb import common_pb2, generate_pb2, worker_pb2
from services.engine.errors import ResourceExhaustedError
from services.router.cancel import CancelScope, RequestCancelledError
from services.router.prompt import ModelInfo, PreparedRequest, prepare_request
from services.router.routing import Routing
from services.router.stats import RequestStats
from services.router.text_stream import TextDelta, TextStream
from services.router.workers import WorkerPool

logger = logging.getLogger(__name__)

# grpc reports a huge time_remaining (not None) for a call without a deadline.
NO_CLIENT_DEADLINE_S = 1e8


class GenerateFlow:
    """Runs Generate requests against a worker pool.

    `model`: tokenizer, vocab size and max_model_len for validation and detokenization.
    `request_timeout`: seconds allowed to a request whose client set no deadline.
    """

    def __init__(
        self,
        model: ModelInfo,
        pool: WorkerPool,
        request_timeout: float = RouterConfig.request_timeout,
        routing: Routing | None = None,
    ) -> None:
        if not request_timeout > 0:
            raise ValueError(f"request_timeout: must be > 0 seconds, got {request_timeout!r}")
        self.model = model
        self.pool = pool
        self.request_timeout = request_timeout
        self.routing = routing if routing is not None else Routing(pool, "round_robin")

    def deadline_for(self, time_remaining: float | None) -> float:
        """Absolute `time.monotonic()` deadline for a client with `time_remaining` seconds left
        (None or no deadline: the router's request_timeout)."""
        if time_remaining is None or time_remaining >= NO_CLIENT_DEADLINE_S:
            time_remaining = self.request_timeout
        return time.monotonic() + time_remaining

    def generate(
        self,
        request: generate_pb2.GenerateRequest,
        deadline: float,
        scope: CancelScope | None = None,
    ) -> Generator[generate_pb2.GenerateResponse, None, None]:
        """Streams the completion; the last message has finish_reason, usage and timings.

        Raises (when iterated): InvalidRequestError / ValueError for bad input (field named),
        ServiceUnavailableError with no workers, TimeoutError past the deadline,
        RequestCancelledError when `scope` is cancelled, grpc.RpcError from a worker.
        Closing the generator early cancels whatever is in flight.
        """
        scope = scope if scope is not None else CancelScope()
        run = _RequestRun(self, request, deadline, scope)
        finished = False
        try:
            for response in run.responses():
                finished = finished or bool(response.finish_reason)
                yield response
        except BaseException as exc:  # GeneratorExit too: the consumer went away
            if not finished:
                run.stats.on_failed(self._failure_code(exc, deadline))
            raise
        finally:
            scope.cancel()  # anything still in flight is no longer wanted

    @staticmethod
    def _failure_code(exc: BaseException, deadline: float) -> grpc.StatusCode:
        """The code for the error counter; a cancel caused by the deadline counts as
        DEADLINE_EXCEEDED."""
        code = grpc.StatusCode.CANCELLED if isinstance(exc, GeneratorExit) else status_for(exc)[0]
        if code == grpc.StatusCode.CANCELLED and time.monotonic() >= deadline:
            return grpc.StatusCode.DEADLINE_EXCEEDED
        return code


class _RequestRun:
    """One request's state while it flows through prefill and decode."""

    def __init__(
        self,
        flow: GenerateFlow,
        request: generate_pb2.GenerateRequest,
        deadline: float,
        scope: CancelScope,
    ) -> None:
        self.flow = flow
        self.request = request
        self.deadline = deadline
        self.scope = scope
        self.stats = RequestStats()
        self.kv_landed = False  # a decode worker reported the prompt KV arrived
        self.request_id = request.request_id
        self.prefill_address = ""
        self.handle: common_pb2.KVHandle | None = None  # the pinned prompt KV, once prefilled

    def responses(self) -> Iterator[generate_pb2.GenerateResponse]:
        prepared = self._prepare()
        text = TextStream(self.flow.model.tokenizer, prepared.prompt_token_ids, prepared.stop)
        prefill = self._prefill(prepared)
        self.handle = prefill.kv_handle if prefill.HasField("kv_handle") else None
        try:  # from here on the prefill worker may hold pinned KV for this request
            first = text.add([prefill.first_token_id])
            first_logprobs = [prefill.first_logprob] if prefill.HasField("first_logprob") else []
            finish = "stop" if first.stopped else prefill.finish_reason
            if not finish and self.handle is None:
                raise RuntimeError(
                    "prefill worker returned neither a finish_reason nor a kv_handle"
                )
            if finish:
                yield self._final(first, text, finish, first_logprobs)
                return
            yield self._message(first, first_logprobs)  # the first token goes out now: that is TTFT
            yield from self._decode_or_retry(prepared, text)
        finally:
            if self.handle is not None and not self.kv_landed:
                self._release_kv(self.handle.request_id or self.request_id, self._kv_source())

    def _kv_source(self) -> str:
        """HOST:PORT serving the handle's KV (a worker that names no source serves it itself)."""
        assert self.handle is not None
        return self.handle.source or self.prefill_address

    def _decode_or_retry(
        self, prepared: PreparedRequest, text: TextStream
    ) -> Iterator[generate_pb2.GenerateResponse]:
        """Decode; if the KV's prefill worker failed before the KV landed, prefill again on
        another healthy worker (once) and decode from there."""
        assert self.handle is not None
        try:
            yield from self._decode(prepared, self.handle, text)
            return
        except grpc.RpcError as exc:
            lost = self._kv_source()
            if (
                self.kv_landed
                or exc.code() != grpc.StatusCode.UNAVAILABLE
                or failed_peer(exc) != lost
            ):
                raise
            self.flow.pool.mark_unhealthy(lost)
            if not [
                a for a in self.flow.pool.prefill if a != lost and a not in self.flow.pool.unhealthy
            ]:
                raise  # no other prefill worker: UNAVAILABLE
            logger.warning(
                "request %s: prefill worker %s lost its KV (%s); prefilling again elsewhere",
                self.request_id,
                lost,
                exc.details(),
            )
        self._release_kv(
            self.handle.request_id or self.request_id, lost
        )  # best effort; its lease covers it
        first_token_id = self.handle.first_token_id
        self.handle = None
        retried = self._prefill(prepared)
        if not retried.HasField("kv_handle"):
            raise ServiceUnavailableError(
                f"request {self.request_id}: the retried prefill returned no KV"
            )
        self.handle = retried.kv_handle
        self.handle.first_token_id = (
            first_token_id  # continue from the token the client already has
        )
        yield from self._decode(prepared, self.handle, text)

    def _remaining(self) -> float:
        """Seconds left until the deadline; TimeoutError when none are."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline exceeded")
        return left

    def _prepare(self) -> PreparedRequest:
        start = time.monotonic()
        prepared = prepare_request(self.request, self.flow.model)
        self.request_id = prepared.request_id
        self.stats.on_tokenized(len(prepared.prompt_token_ids), time.monotonic() - start)
        needed = len(prepared.prompt_token_ids) + prepared.params.max_tokens
        capacity = self.flow.pool.decode_capacity()
        if capacity is not None and needed > capacity:  # refused before any prefill work
            raise ResourceExhaustedError(
                f"prompt ({len(prepared.prompt_token_ids)} tokens) + "
                f"max_tokens ({prepared.params.max_tokens}) can never fit: "
                f"the largest decode worker's KV cache holds {capacity} tokens per request"
            )
        return prepared

    def _prefill(self, prepared: PreparedRequest) -> worker_pb2.PrefillResponse:
        """Runs the Prefill RPC on a picked worker; cancellable through the scope. A worker that
        answers UNAVAILABLE (dead, or draining) is marked unhealthy and the call goes once to
        another healthy worker, if there is one."""
        routing, num_prompt = self.flow.routing, len(prepared.prompt_token_ids)
        for attempt in (1, 2):
            self.prefill_address, _ = routing.pick_prefill(
                prepared.prompt_token_ids, prepared.cache_salt
            )
            try:
                response = self._call_prefill(prepared)
            except grpc.RpcError as exc:
                if attempt == 2 or exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                self.flow.pool.mark_unhealthy(self.prefill_address)
                if self.flow.pool.healthy_prefill() == [self.prefill_address]:
                    raise  # no other worker to try
                continue
            finally:
                routing.prefill_done(self.prefill_address, num_prompt)
            routing.learn_routed(
                self.prefill_address, prepared.prompt_token_ids, prepared.cache_salt
            )
            return response
        raise AssertionError("unreachable")

    def _call_prefill(self, prepared: PreparedRequest) -> worker_pb2.PrefillResponse:
        stub = self.flow.pool.prefill_stub(self.prefill_address)
        message = worker_pb2.PrefillRequest(
            request_id=prepared.request_id,
            prompt_token_ids=prepared.prompt_token_ids,
            sampling=sampling_to_proto(prepared.params),
            cache_salt=prepared.cache_salt,
        )
        self.scope.check()
        start = time.monotonic()
        future = self.scope.track(stub.Prefill.future(message, timeout=self._remaining()))
        try:
            response = future.result()
        except grpc.FutureCancelledError:
            # The worker may have pinned the prompt KV just as we cancelled: release it by id
            # (a release that arrives before the pin is remembered and applied to it).
            self._release_kv(prepared.request_id, self.prefill_address)
            raise RequestCancelledError() from None
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                self._release_kv(prepared.request_id, self.prefill_address)
            raise
        finally:
            self.scope.untrack(future)
        self.stats.on_prefill(time.monotonic() - start, response.num_cached_tokens)
        return response

    def _decode(
        self, prepared: PreparedRequest, handle: common_pb2.KVHandle, text: TextStream
    ) -> Iterator[generate_pb2.GenerateResponse]:
        """Streams the Decode RPC's tokens through `text` until a finish_reason or stop string."""
        address = self.flow.routing.pick_decode()
        try:
            yield from self._stream_decode(prepared, handle, text, address)
        except grpc.RpcError as exc:
            if (
                exc.code() == grpc.StatusCode.UNAVAILABLE and failed_peer(exc) is None
            ):  # the decode worker itself
                raise PeerUnavailableError(
                    f"decode worker {address}: {exc.details()}", peer=address
                ) from exc
            raise
        finally:
            self.flow.routing.decode_done(address)

    def _stream_decode(
        self, prepared: PreparedRequest, handle: common_pb2.KVHandle, text: TextStream, address: str
    ) -> Iterator[generate_pb2.GenerateResponse]:
        stub = self.flow.pool.decode_stub(address)
        message = worker_pb2.DecodeRequest(
            request_id=prepared.request_id,
            prompt_token_ids=prepared.prompt_token_ids,
            sampling=sampling_to_proto(prepared.params),
            kv_handle=handle,
            cache_salt=prepared.cache_salt,
        )
        self.scope.check()
        call = self.scope.track(stub.Decode(message, timeout=self._remaining()))
        self.stats.on_decode_started()
        try:
            for reply in call:
                if not self.kv_landed:
                    self.kv_landed = True
                    self.stats.on_kv_transfer(reply.kv_transfer_seconds)
                delta = text.add(list(reply.token_ids))
                if delta.stopped:
                    call.cancel()  # the decode worker frees the request's blocks now
                    yield self._final(delta, text, "stop", reply.logprobs)
                    return
                if reply.finish_reason:
                    yield self._final(delta, text, reply.finish_reason, reply.logprobs)
                    _drain(call)  # read the OK status rather than cancel a finished call
                    return
                if delta.token_ids:
                    yield self._message(delta, reply.logprobs)
            raise RuntimeError("decode worker ended its stream without a finish_reason")
        finally:
            self.scope.untrack(call)
            call.cancel()  # no-op once the stream has completed; frees the worker otherwise

    def _message(
        self, delta: TextDelta, logprobs: Sequence[common_pb2.TokenLogprob]
    ) -> generate_pb2.GenerateResponse:
        """A streamed message; `logprobs` (empty unless asked for) are those of the tokens the
        worker sent, of which the accepted `delta.token_ids` are a prefix."""
        self.stats.on_tokens_sent(len(delta.token_ids))
        return generate_pb2.GenerateResponse(
            token_ids=delta.token_ids,
            text=delta.text,
            logprobs=list(logprobs)[: len(delta.token_ids)],
        )

    def _final(
        self,
        delta: TextDelta,
        text: TextStream,
        finish_reason: str,
        logprobs: Sequence[common_pb2.TokenLogprob],
    ) -> generate_pb2.GenerateResponse:
        """The last message: remaining text (held-back text is released), usage, timings."""
        chunk = delta.text
        if not delta.stopped:
            tail, stopped = text.finish()
            chunk += tail
            finish_reason = "stop" if stopped else finish_reason
        if delta.token_ids:
            self.stats.on_tokens_sent(len(delta.token_ids))
        self.stats.on_finished(finish_reason)
        return generate_pb2.GenerateResponse(
            token_ids=delta.token_ids,
            text=chunk,
            finish_reason=finish_reason,
            usage=self.stats.usage(),
            timings=self.stats.timings(),
            logprobs=list(logprobs)[: len(delta.token_ids)],
        )

    def _release_kv(self, request_id: str, source: str) -> None:
        """Unpins a request's prompt KV on the prefill worker at `source` (best effort; a lapsed
        lease frees it too). Sent without waiting: a busy worker answers between engine steps,
        and the request's thread has nothing to wait for."""
        try:
            release_kv(self.flow.pool.channel(source), request_id, source)
        except ValueError as exc:  # a malformed source address
            logger.warning("ReleaseKV(%s) at %r not sent: %s", request_id, source, exc)


class _ResponseStream(Protocol):
    """A response-streaming gRPC call: an iterator over its messages that can be cancelled."""

    def __iter__(self) -> Iterator[object]: ...

    def cancel(self) -> bool: ...


def _drain(call: _ResponseStream) -> None:
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
