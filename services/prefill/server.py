"""Prefill worker process: a gRPC adapter around an engine in PREFILL role.

Prefill runs the prompt, samples the first token, and keeps the prompt's blocks pinned under a
lease (`EngineConfig.kv_lease_seconds`, `--kv-lease-seconds`) that the decode worker renews while
it wants them and ends with ReleaseKV; a lapsed lease frees them
(`services/kv_transfer/lease.py`).
"""

from __future__ import annotations

import logging
import threading
import uuid

from services.common import metrics
from services.common.convert import handle_to_proto, logprobs_to_proto, sampling_from_proto
from services.common.errors import ServiceUnavailableError
from services.common.grpc_server import start_service
from services.common.pb import worker_pb2, worker_pb2_grpc
from services.config.roles import PrefillConfig
from services.engine import Engine
from services.engine.errors import InvalidRequestError
from services.kv_transfer import registry
from services.kv_transfer.control.service import KVTransferServicer, add_kv_transfer_servicer
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

PREFILL_MAX_CALLS = 1024  # handler threads, as the router (whose admission bounds the calls)


class PrefillServicer(worker_pb2_grpc.PrefillServicer):
    def __init__(self, loop: EngineLoop, config: PrefillConfig) -> None:
        self.loop = loop
        self.config = config
        self.draining = threading.Event()  # set on SIGTERM: new requests are refused
        self.kv_address = ""  # HOST:PORT of this process's KVTransfer service, set once bound

    def Prefill(self, request, context):
        request_id = request.request_id or f"req-{uuid.uuid4().hex}"
        if self.draining.is_set():
            raise ServiceUnavailableError(
                "this prefill worker is draining (SIGTERM): send the request elsewhere"
            )
        if not request.prompt_token_ids:
            raise InvalidRequestError("prompt_token_ids", "must not be empty")
        params = sampling_from_proto(request.sampling)
        stream = self.loop.submit(
            request_id,
            list(request.prompt_token_ids),
            params,
            cache_salt=cache_salt(request.cache_salt),
            caller_active=context.is_active,
            output_token_ids=list(request.output_token_ids),
        )
        out = next_output(stream, context)
        if out is None:  # the router went away or its deadline passed: nothing stays pinned
            self.loop.abort_soon(request_id)  # this thread need not wait for a step to end
            return worker_pb2.PrefillResponse()
        response = worker_pb2.PrefillResponse(
            first_token_id=out.new_token_ids[0], num_cached_tokens=out.num_cached_tokens
        )
        if out.metrics is not None:
            response.queue_seconds = out.metrics.time_in_queue
            response.compute_seconds = out.metrics.time_to_first_token
        if out.new_logprobs:
            response.first_logprob.CopyFrom(logprobs_to_proto(out.new_logprobs[0]))
        if out.kv_handle is None:  # the first token already finished the request
            response.finish_reason = out.finish_reason
            return response
        if not context.is_active():  # the router left as the prefill finished: no one will pull
            self.loop.abort_soon(request_id)
        response.kv_handle.CopyFrom(handle_to_proto(out.kv_handle, self.kv_address))
        return response

    def GetInfo(self, request, context):
        return worker_info(self.loop, self.config)


def start_prefill(config: PrefillConfig) -> RunningWorker:
    """Start the prefill worker `config` describes and return once it accepts requests (what
    `serve`, the tests and the Ray deployment call): its engine has warmed up and its health
    says SERVING (NOT_SERVING until then). Raises ValueError naming a bad field, OSError naming
    the port that cannot be bound, and what `RunningWorker.warm_up_and_serve` raises."""
    backend, device = config.kv_transfer_backend, config.engine.device.split(":")[0]
    sender = registry.make_sender(backend, device, config.engine.kv_lease_seconds)
    engine = Engine(config.engine_config(), kv_sender=sender)
    offered = registry.offered(backend, sender, device)
    logger.info("KV transfer: --kv-transfer-backend %s, serving %s", backend, offered)
    if device.startswith("cuda"):
        logger.info("KV transfer topology: %s", cuda_topology())
    loop = EngineLoop(engine, "prefill", config.step_log, config.threads, worker_cpus(config))

    def expire_leases() -> None:  # nobody renewed them: the decode worker (or router) is gone
        for request_id in sender.expire_leases():
            logger.warning("KV lease of %s lapsed: its blocks are freed", request_id)
            metrics.KV_TRANSFER_FAILURES.labels("prefill", "lease_expired").inc()

    loop.add_idle_hook(expire_leases)
    prefill = PrefillServicer(loop, config)
    admin = AdminServicer(loop, config)
    kv = KVTransferServicer(
        sender,
        loop.post,
        engine.kv_peer_info,
        stall_s=config.debug_kv_stall_seconds,
        backends=offered[1:],
        device=config.engine.device,
        dist_host=config.host if config.host not in ("", "0.0.0.0", "::") else "127.0.0.1",
        cuda_kv=engine.kv_cache.kv if "cuda_ipc" in offered else None,
    )
    service = start_service(
        "prefill",
        [
            (worker_pb2_grpc.add_PrefillServicer_to_server, prefill, "pdserve.v1.Prefill"),
            (add_kv_transfer_servicer, kv, "pdserve.v1.KVTransfer"),
            (worker_pb2_grpc.add_AdminServicer_to_server, admin, "pdserve.v1.Admin"),
        ],
        config.host,
        config.port,
        config.metrics_port,
        serving=False,  # until the engine has warmed up
        # Each Prefill call holds a thread until its first token: a queue of them must leave
        # threads for health checks and KV control calls (with 64, 200 concurrent prompts made
        # the router's health checks time out and mark this worker down). Idle threads exit.
        max_workers=PREFILL_MAX_CALLS,
        max_concurrent_rpcs=config.max_concurrent_rpcs,
    )
    prefill.kv_address = service.grpc_address
    prefill.config = admin.config = effective_config(config, engine.config, service)
    loop.start()
    publisher = publish_prefix_cache(
        loop, service.grpc_address, config.index.redis_url, config.index.index_ttl
    )

    def close() -> None:
        if publisher is not None:
            publisher.stop()
        loop.stop()
        kv.close_groups()
        sender.close()

    def drained() -> bool:  # nothing running, nothing pinned for a decode worker to pull
        return loop.call(lambda: not engine.has_unfinished_requests() and not engine.pinned)

    worker = RunningWorker(service, loop, prefill.draining, drained, close)
    threads = config.threads or engine.num_threads()
    worker.warm_up_and_serve(
        lambda: settle_step_cost(engine, threads, "saved"), config.core_ledger
    )  # the saved fit decides which queued prompts share a step (`step_budget.worth_packing`)
    worker.join_routers(config.register_with)
    return worker


def serve(config: PrefillConfig) -> None:
    """Start the prefill worker, print its ready line, block until SIGINT/SIGTERM, drain."""
    start_prefill(config).serve_forever(config.drain_timeout)
