"""One request through the workers: Prefill, then the Decode stream, then text.

Every downstream call gets `timeout=` the time left until the deadline, so nothing waits
unbounded. Errors propagate as they are (a downstream `grpc.RpcError` keeps its code; typed
errors are mapped by `services.common.errors.ErrorInterceptor`). Freeing work downstream:
- a cancel (client gone, deadline, the router shutting down) or a stop-string hit cancels the
  in-flight call, so the decode worker frees the request's blocks;
- if the request ends after the prefill pinned its KV but before a decode worker reported the
  KV landed (client gone, stop string in the first token, Decode failed or was never started),
  the router calls `KVTransfer.ReleaseKV` on the prefill worker named in the handle.
Failures of a worker mid-request:
- a Prefill call (`prefill_call.py`) whose worker is UNAVAILABLE (dead, draining, or
  stalled while failing its health checks) goes once to another healthy prefill worker;
- a decode worker that dies or stalls, or a prefill worker that loses the KV before it landed,
  moves the request to another worker (`migration.py`): the prompt plus the tokens already
  streamed are prefilled again and the stream goes on from the next token.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import grpc

from services.common.channels import release_kv
from services.common.errors import PeerUnavailableError
from services.engine.errors import InvalidRequestError
from services.router.flow.cancel import CancelScope
from services.router.flow.context import FlowContext
from services.router.flow.messages import GenerationOutput, GenerationRequest
from services.router.flow.migration import WorkerLost, decode_failure
from services.router.flow.prefill_call import PrefillCall
from services.router.flow.prompt import PreparedRequest, prepare_request
from services.router.flow.request_stats import RequestStats
from services.router.flow.responses import delta_output, final_output
from services.router.flow.siblings import Siblings
from services.router.flow.text_stream import TextStream
from services.router.flow.watchdog import Watch
from services.router.pool.serving_path import PathChoice
from services.router.pool.worker_calls import DecodeStream, RemoteKV, WorkerRequest, start_decode

logger = logging.getLogger(__name__)


class RequestRun:
    """One request's state while it flows through prefill and decode."""

    def __init__(
        self,
        context: FlowContext,
        request: GenerationRequest,
        deadline: float,
        scope: CancelScope,
        siblings: Siblings | None = None,
        leader: bool = True,
        received: float | None = None,
    ) -> None:
        self.context = context
        self.siblings, self.leader = siblings, leader
        self.request = request
        self.deadline = deadline
        self.scope = scope
        self.stats = RequestStats() if received is None else RequestStats(start=received)
        self.stats.counts_prompt = leader  # n choices of one prompt count its tokens once
        self.kv_landed = False  # a decode worker reported the prompt KV arrived
        self.request_id = request.request_id
        self.engine_request_id = request.request_id  # the workers' id (one per attempt)
        self.prefill_address = ""
        self.kv: RemoteKV | None = None  # the pinned prompt KV, once prefilled
        self.choice = PathChoice("remote", "mode")  # the serving path (`choose_path`)
        self.chosen_at = 0.0  # when it was chosen (time.monotonic seconds)
        self.local_tokens = 0  # prompt tokens the decode worker is prefilling locally for us
        self.prefill = PrefillCall(
            context, scope, self.stats, self._remaining, self._release_kv, siblings, leader
        )

    def outputs(self) -> Iterator[GenerationOutput]:
        self.stats.on_started()
        prepared = self._prepare()
        self.choice = self.context.choose_path(
            prepared.prompt_token_ids, prepared.cache_salt, *prepared.path_objectives()
        )
        self.chosen_at = time.monotonic()
        self.stats.on_path(self.choice)
        text = TextStream(self.context.model.tokenizer, prepared.prompt_token_ids, prepared.stop)
        try:
            while True:
                try:
                    yield from self._attempt(prepared, text)
                    return
                except WorkerLost as lost:
                    self._migrate(lost, text)
        finally:
            self._release_unlanded()
            if self.siblings is not None and self.leader:
                self.siblings.ended()

    def _attempt(self, prepared: PreparedRequest, text: TextStream) -> Iterator[GenerationOutput]:
        """Prefill (on the prefill pool or the decode worker), then decode. After a migration
        the prompt plus the tokens the client already has are prefilled, and decoding resumes
        from the next token. Raises WorkerLost when a worker fails mid-request."""
        resumed = list(text.token_ids)
        self.kv_landed = False
        if resumed:
            self.engine_request_id = f"{prepared.request_id}-m{self.stats.migrations}"
        if resumed:  # the prompt and the tokens streamed so far, where they now fit best
            context = [*prepared.prompt_token_ids, *resumed]
            self.choice = self.context.choose_path(
                context, prepared.cache_salt, *prepared.path_objectives()
            )
        if self.choice.path == "local":  # the decode worker prefills it: no KV to ship
            yield from self._decode(prepared, None, text, resumed)
            return
        prefill = self.prefill.run(prepared, resumed, self.engine_request_id)
        if not resumed:
            self.context.first_token(self.choice, time.monotonic() - self.chosen_at)
        self.prefill_address = self.prefill.prefill_address
        self.kv = prefill.kv
        # from here on the prefill worker may hold pinned KV for this request
        first = text.add([prefill.first_token_id])
        first_logprobs = [prefill.first_logprob] if prefill.first_logprob is not None else []
        finish = "stop" if first.stopped else prefill.finish_reason
        if not finish and self.kv is None:
            raise RuntimeError("prefill worker returned neither a finish_reason nor a kv_handle")
        if finish:
            yield final_output(first, text, finish, first_logprobs, self.stats)
            return
        # the first token goes out now: that is TTFT (after a migration, just the next token)
        yield delta_output(first, first_logprobs, self.stats)
        yield from self._decode(prepared, self.kv, text, resumed)

    def _migrate(self, lost: WorkerLost, text: TextStream) -> None:
        """Takes the failed worker out of routing and readies the next attempt; raises
        PeerUnavailableError (naming it) past max_migrations or when no healthy worker of its
        role turns up within migration_wait seconds."""
        config, pool = self.context.migration, self.context.pool
        pool.mark_unhealthy(lost.address)
        self._release_unlanded()
        if self.stats.migrations >= config.max_migrations:
            raise PeerUnavailableError(
                f"{lost} after {self.stats.migrations} migration(s) (--max-migrations "
                f"{config.max_migrations})",
                peer=lost.address,
            ) from lost
        self.stats.on_migrated(lost.reason)
        logger.warning(
            "request %s: %s; migrating it (%d of at most %d) with %d tokens generated",
            self.request_id,
            lost,
            self.stats.migrations,
            config.max_migrations,
            text.num_tokens,
        )
        if not pool.wait_healthy(lost.role, min(config.migration_wait, self._remaining())):
            raise PeerUnavailableError(
                f"{lost}; no healthy {lost.role} worker to migrate to within "
                f"{config.migration_wait:g} s (--migration-wait)",
                peer=lost.address,
            ) from lost

    def _release_unlanded(self) -> None:
        """Unpins the prompt KV of a handle no decode worker reported landed (best effort)."""
        if self.kv is not None and not self.kv_landed:
            self._release_kv(self.kv.handle.request_id or self.engine_request_id, self._kv_source())
        self.kv = None

    def _kv_source(self) -> str:
        """HOST:PORT serving the handle's KV (a worker that names no source serves it itself)."""
        assert self.kv is not None
        return self.kv.source or self.prefill_address

    def _remaining(self) -> float:
        """Seconds left until the deadline; TimeoutError when none are."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline exceeded")
        return left

    def _prepare(self) -> PreparedRequest:
        start = time.monotonic()
        prepared = prepare_request(self.request, self.context.model)
        self.request_id = self.engine_request_id = prepared.request_id
        self.stats.on_tokenized(len(prepared.prompt_token_ids), time.monotonic() - start)
        needed = len(prepared.prompt_token_ids) + prepared.params.max_tokens
        capacity = self.context.pool.decode_capacity()
        if capacity is not None and needed > capacity:  # refused before any prefill work
            raise InvalidRequestError(
                "max_tokens",
                f"prompt ({len(prepared.prompt_token_ids)} tokens) + "
                f"max_tokens ({prepared.params.max_tokens}) can never fit: "
                f"the largest decode worker's KV cache holds {capacity} tokens per request",
            )
        return prepared

    def _decode(
        self,
        prepared: PreparedRequest,
        kv: RemoteKV | None,
        text: TextStream,
        resumed: list[int],
    ) -> Iterator[GenerationOutput]:
        """Streams the Decode RPC's tokens through `text` until a finish_reason or stop string;
        without `kv`, the decode worker prefills the prompt (+ `resumed`) itself (the
        local path). Raises WorkerLost when the decode worker (or the KV's source) fails."""
        self.stats.on_decode_started()  # a sibling's wait for the leader's KV is decode queue
        prefer = self.choice.decode if kv is None else None  # where the local path was predicted
        if self.siblings is not None and not self.leader and not resumed:
            prefer = self.siblings.decode_worker(self._remaining())
        routing = self.context.routing
        num_context = len(prepared.prompt_token_ids) + len(resumed)
        address = routing.pick_decode(prefer, num_context)
        routing.learn_routed(address, [*prepared.prompt_token_ids, *resumed], prepared.cache_salt)
        self.local_tokens = num_context if kv is None else 0  # prefilling there until it lands
        routing.local_prefill(address, self.local_tokens)
        request = WorkerRequest(
            self.engine_request_id,
            prepared.prompt_token_ids,
            prepared.params,
            prepared.cache_salt,
            resumed,
            prepared.itl_objective_ms,
            prepared.tpot_objective_ms,
            prepared.ttft_left_ms(
                self.chosen_at, self.context.paths.slo_ttft_ms, kv is None and not resumed
            ),
        )
        try:  # decode_done on every path, a cancel before the call starts included
            self.scope.check()
            call = self.scope.track(
                start_decode(self.context.pool, address, request, kv, self._remaining())
            )
            try:
                with self.context.watchdog.watch(address, call) as watch:
                    yield from self._stream_decode(call, kv, text, address, watch)
            except grpc.RpcError as exc:
                if self.scope.cancelled:
                    raise self.scope.error() from exc
                source = self._kv_source() if kv is not None else None
                lost = decode_failure(exc, address, source, self.kv_landed, watch.stalled)
                if lost is not None:
                    raise lost from exc
                raise
            finally:
                self.scope.untrack(call)
                call.cancel()  # no-op once the stream has completed; frees the worker otherwise
        finally:
            routing.decode_done(address, num_context)
            routing.local_prefill(address, -self.local_tokens)

    def _stream_decode(
        self,
        call: DecodeStream,
        kv: RemoteKV | None,
        text: TextStream,
        address: str,
        watch: Watch,
    ) -> Iterator[GenerationOutput]:
        for reply in call:
            watch.progress()
            if not self.kv_landed:  # the prompt's KV is in the decode worker's cache now
                self.kv_landed = True
                if kv is None:  # this reply carries the first token
                    self.stats.on_local_prefill(reply.compute_seconds, reply.num_cached_tokens)
                    if not self.stats.migrations:
                        self.context.first_token(self.choice, time.monotonic() - self.chosen_at)
                    self.context.routing.local_prefill(address, -self.local_tokens)
                    self.local_tokens = 0
                else:
                    self.stats.on_first_decode(reply.kv_transfer_seconds, reply.compute_seconds)
                if self.siblings is not None and self.leader:
                    self.siblings.landed(address)
            elif kv is None and self.stats.first_decode_at is None and reply.token_ids:
                self.stats.on_local_first_decode()  # the local path's second token
            delta = text.add(list(reply.token_ids))
            if delta.stopped:
                call.cancel()  # the decode worker frees the request's blocks now
                yield final_output(delta, text, "stop", reply.logprobs, self.stats)
                return
            if reply.finish_reason:
                yield final_output(delta, text, reply.finish_reason, reply.logprobs, self.stats)
                call.drain()  # read the OK status rather than cancel a finished call
                return
            if delta.token_ids:
                yield delta_output(delta, reply.logprobs, self.stats)
        raise RuntimeError("decode worker ended its stream without a finish_reason")

    def _release_kv(self, request_id: str, source: str) -> None:
        """Unpins a request's prompt KV on the prefill worker at `source` (best effort; a lapsed
        lease frees it too). Sent without waiting: a busy worker answers between engine steps,
        and the request's thread has nothing to wait for."""
        try:
            release_kv(self.context.pool.channel(source), request_id, source)
        except ValueError as exc:  # a malformed source address
            logger.warning("ReleaseKV(%s) at %r not sent: %s", request_id, source, exc)
