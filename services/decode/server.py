"""Decode worker process: a gRPC adapter around an engine in DECODE role.

Each Decode call names a prefill worker's KV handle (or none: the local path below). The RPC
thread handshakes with that worker (once per prefill engine), the engine reserves the request's
blocks (or queues it, bounded), the RPC thread pulls the prompt KV it lacks over gRPC (4 MiB
chunks, within `--kv-transfer-timeout`) while the engine keeps stepping the running batch, and
the engine then loads it, releases the prefill pin, joins the batch and streams one token per
step. Failures end the call with a clear status: FAILED_PRECONDITION (layouts differ),
RESOURCE_EXHAUSTED (too many wait for blocks), DEADLINE_EXCEEDED (the KV did not arrive in
time), UNAVAILABLE naming the prefill worker in the `pdserve-failed-peer` trailer (it died or
lost the KV: the router retries elsewhere). A cancelled or failed call frees the request's
blocks at once.

A Decode call without a KV handle is the local path of conditional disaggregation: this worker
prefills the prompt itself, chunked into its running batch's steps, and streams every token.
"""

from __future__ import annotations

import contextlib
import logging
import threading

from services.common import metrics
from services.common.convert import handle_from_proto, logprobs_to_proto, sampling_from_proto
from services.common.errors import PeerUnavailableError, ServiceUnavailableError, ShuttingDownError
from services.common.grpc_server import start_service
from services.common.pb import worker_pb2, worker_pb2_grpc
from services.config.roles import DecodeConfig
from services.engine import Engine
from services.engine.errors import InvalidRequestError, KVHandshakeError, KVTransferError
from services.engine.objectives import StreamObjectives
from services.engine.outputs import KVReserved, RequestOutput
from services.kv_transfer.control.receiver import GrpcKVReceiver
from services.kv_transfer.cuda_ipc.export import cuda_topology
from services.prefix_index.publisher import publish_prefix_cache
from services.worker.cpus import worker_cpus
from services.worker.engine_loop import EngineLoop
from services.worker.runtime import (
    AdminServicer,
    RunningWorker,
    cache_salt,
    effective_config,
    next_output,
    worker_info,
)
from services.worker.step_cost import settle_step_cost

logger = logging.getLogger(__name__)


class DecodeServicer(worker_pb2_grpc.DecodeServicer):
    def __init__(self, loop: EngineLoop, transfer: GrpcKVReceiver, config: DecodeConfig) -> None:
        self.loop = loop
        self.config = config
        self.transfer = transfer
        self.draining = threading.Event()  # set on SIGTERM: new requests are refused
        self.num_streams = 0  # Decode calls in progress
        self._lock = threading.Lock()

    def Decode(self, request, context):
        if self.draining.is_set():
            raise ServiceUnavailableError(
                "this decode worker is draining (SIGTERM): send the request elsewhere"
            )
        with self._lock:
            self.num_streams += 1
        try:
            yield from self._decode(request, context)
        finally:
            with self._lock:
                self.num_streams -= 1

    def _decode(self, request, context):
        if not request.request_id:
            raise InvalidRequestError("request_id", "a decode request needs a request_id")
        params = sampling_from_proto(request.sampling)
        prompt_ids, salt = list(request.prompt_token_ids), cache_salt(request.cache_salt)
        request_id, resumed = request.request_id, list(request.output_token_ids)
        objectives = StreamObjectives.from_ms(
            request.itl_objective_ms, request.tpot_objective_ms, request.ttft_objective_ms
        )
        if not request.HasField("kv_handle"):
            yield from self._prefill_here(
                request_id, prompt_ids, params, salt, resumed, objectives, context
            )
            return
        handle, source = handle_from_proto(request.kv_handle)
        if self.config.debug_recompute_prompt:
            logger.warning(
                "recomputing the prompt of %s instead of pulling its KV from %s "
                "(--debug-recompute-prompt)",
                request_id,
                source,
            )
        self.transfer.set_source(request_id, source)  # its lease is renewed from now on
        try:
            self.transfer.connect(
                handle, self.loop.engine.kv_peer_info
            )  # on this thread: a network call
            stream = self.loop.submit(
                request_id,
                prompt_ids,
                params,
                kv_handle=handle,
                cache_salt=salt,
                output_token_ids=resumed,
                objectives=objectives,
            )  # always added, even if the caller left: its abort tells the source to unpin
            landed = False
            while (out := next_output(stream, context)) is not None:
                if isinstance(out, KVReserved):  # pull on this thread; the batch keeps stepping
                    self._write_kv(handle, out, context)
                    continue
                if out.finish_reason in ("error", "kv_timeout"):
                    raise self._kv_failure(request_id, source, out.finish_reason)
                # Ended at admission: only the prefill's first token, nothing new.
                new = out.new_token_ids if len(out.output_token_ids) > len(resumed) + 1 else []
                pulled = 0.0 if landed else self.transfer.pull_seconds.get(request_id, 0.0)
                yield _reply(out, new, first=not landed, kv_transfer_seconds=pulled)
                landed = True
                if out.finished:
                    return
        except KVHandshakeError:
            self.transfer.complete(handle)  # the KV is unusable here: let the source unpin now
            raise  # FAILED_PRECONDITION
        except KVTransferError as exc:
            raise self._kv_failure(request_id, source, exc.reason, str(exc)) from exc
        finally:
            with contextlib.suppress(ShuttingDownError):  # the engine is gone: nothing to free
                # No-op once finished; on a cancel or failure it frees the blocks and, if the KV
                # never landed, tells the prefill worker to unpin.
                self.loop.abort(request_id)
            self.transfer.forget(request_id)

    def _prefill_here(
        self, request_id: str, prompt_ids, params, salt, resumed, objectives, context
    ):
        """The local path: no KV handle, so this engine prefills the prompt (and a migrated
        request's `resumed` outputs) itself, chunked into the running batch's steps; the replies
        carry every new token, the first one included."""
        try:
            stream = self.loop.submit(
                request_id,
                prompt_ids,
                params,
                cache_salt=salt,
                caller_active=context.is_active,
                output_token_ids=resumed,
                objectives=objectives,
            )
            first = True
            while (out := next_output(stream, context)) is not None:
                yield _reply(out, out.new_token_ids, first)
                first = False
                if out.finished:
                    return
        finally:
            with contextlib.suppress(ShuttingDownError):
                self.loop.abort(request_id)  # no-op once finished; frees blocks on a cancel

    def _write_kv(self, handle, reserved: KVReserved, context) -> None:
        """Pull the prompt KV the local prefix cache lacks straight into the reserved blocks
        (the engine keeps them allocated until `kv_written`); a cancelled Decode call cancels
        the pull. Raises KVTransferError."""
        kv_cache, ok = self.loop.engine.kv_cache, False
        try:
            for offset, piece in self.transfer.pull_chunks(
                handle, reserved.first_block, on_call=lambda call: context.add_callback(call.cancel)
            ):
                kv_cache.write_transferred(reserved.block_ids, offset, piece)
            ok = True
        finally:
            with contextlib.suppress(ShuttingDownError):
                self.loop.kv_written(reserved.request_id, ok)

    def _kv_failure(self, request_id: str, source: str, reason: str, detail: str = "") -> Exception:
        """The status for a request whose prompt KV never landed; `detail`: the transfer's own
        error message, which names the request and the source."""
        if reason in ("kv_timeout", "deadline_exceeded"):
            if reason == "kv_timeout":
                metrics.KV_TRANSFER_FAILURES.labels("decode", reason).inc()
            timeout = self.loop.engine.config.kv_transfer_timeout_s
            return TimeoutError(
                f"prompt KV of {request_id!r} from {source} did not arrive within {timeout:g} s "
                f"(--kv-transfer-timeout)"
            )
        return PeerUnavailableError(
            detail or f"prompt KV of {request_id!r} could not be pulled from {source}", peer=source
        )

    def GetInfo(self, request, context):
        return worker_info(self.loop, self.config)


def _reply(
    out: RequestOutput, token_ids: list[int], first: bool, kv_transfer_seconds: float = 0.0
) -> worker_pb2.DecodeResponse:
    """One Decode message for `out`; the `first` carries the KV pull's seconds, the prefix-cache
    hit and, once the engine sampled its first token, its queue and compute seconds."""
    reply = worker_pb2.DecodeResponse(
        token_ids=token_ids,
        finish_reason=out.finish_reason if out.finished else "",
        kv_transfer_seconds=kv_transfer_seconds,
        num_cached_tokens=out.num_cached_tokens,
        logprobs=[logprobs_to_proto(lp) for lp in out.new_logprobs],
    )
    if first and out.metrics is not None:
        reply.queue_seconds = out.metrics.time_in_queue
        reply.compute_seconds = out.metrics.time_to_first_token
    return reply


def start_decode(config: DecodeConfig) -> RunningWorker:
    """Start the decode worker `config` describes and return once it accepts requests (what
    `serve`, the tests and the Ray deployment call): its engine has warmed up and its health
    says SERVING (NOT_SERVING until then). Raises ValueError naming a bad field, OSError naming
    the port that cannot be bound, and what `RunningWorker.warm_up_and_serve` raises."""
    engine_config = config.engine_config()
    transfer = GrpcKVReceiver(
        engine_config.engine_id,
        timeout_s=engine_config.kv_transfer_timeout_s,
        zero_block=config.debug_zero_kv_block,
        backend=config.kv_transfer_backend,
        device=engine_config.device,
    )
    logger.info("KV transfer: --kv-transfer-backend %s", config.kv_transfer_backend)
    if engine_config.device.startswith("cuda"):
        logger.info("KV transfer topology: %s", cuda_topology())
    engine = Engine(engine_config, kv_receiver=transfer)
    loop = EngineLoop(engine, "decode", config.step_log, config.threads, worker_cpus(config))
    decode = DecodeServicer(loop, transfer, config)
    admin = AdminServicer(loop, config)
    service = start_service(
        "decode",
        [
            (worker_pb2_grpc.add_DecodeServicer_to_server, decode, "pdserve.v1.Decode"),
            (worker_pb2_grpc.add_AdminServicer_to_server, admin, "pdserve.v1.Admin"),
        ],
        config.host,
        config.port,
        config.metrics_port,
        max_workers=engine_config.max_num_seqs + 64,  # each running request holds one stream
        serving=False,  # until the engine has warmed up
        max_concurrent_rpcs=config.max_concurrent_rpcs,
    )
    decode.config = admin.config = effective_config(config, engine.config, service)
    loop.start()
    publisher = publish_prefix_cache(
        loop, service.grpc_address, config.index.redis_url, config.index.index_ttl
    )

    def close() -> None:
        if publisher is not None:
            publisher.stop()
        loop.stop()
        transfer.close()

    worker = RunningWorker(service, loop, decode.draining, lambda: decode.num_streams == 0, close)
    threads = config.threads or engine.num_threads()
    worker.warm_up_and_serve(
        lambda: settle_step_cost(engine, threads, config.cost_model), config.core_ledger
    )
    worker.join_routers(config.register_with)
    return worker


def serve(config: DecodeConfig) -> None:
    """Start the decode worker, print its ready line, block until SIGINT/SIGTERM, drain."""
    start_decode(config).serve_forever(config.drain_timeout)
