"""Prefill worker process: a gRPC adapter around an engine in PREFILL role.

Prefill runs the prompt, samples the first token, and keeps the prompt's blocks pinned under a
lease (`--kv-lease-seconds`, default 30 s) that the decode worker renews while it wants them and
ends with ReleaseKV; a lapsed lease frees them (`services/engine/kv_transfer/lease.py`).
"""

from __future__ import annotations

import argparse
import logging
import threading
import uuid

from services.common import metrics
from services.common.convert import handle_to_proto, logprobs_to_proto, sampling_from_proto
from services.common.engine_loop import EngineLoop
from services.common.errors import ServiceUnavailableError
from services.common.kv_publisher import KVEventPublisher
from services.common.kv_transfer_grpc import GrpcKVTransfer
from services.common.kv_transfer_service import KVTransferServicer, add_kv_transfer_servicer
from services.common.pb import worker_pb2, worker_pb2_grpc
from services.common.prefix_index import make_prefix_index
from services.common.server import start_service, wait_for_termination
from services.common.worker import (
    AdminServicer,
    cache_salt,
    engine_config,
    next_output,
    worker_info,
)
from services.engine import Engine, EngineRole
from services.engine.errors import InvalidRequestError

logger = logging.getLogger(__name__)


class PrefillServicer(worker_pb2_grpc.PrefillServicer):
    def __init__(self, loop: EngineLoop) -> None:
        self.loop = loop
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
        )
        out = next_output(stream, context)
        if out is None:  # the router went away or its deadline passed: nothing stays pinned
            self.loop.abort(request_id)
            return worker_pb2.PrefillResponse()
        response = worker_pb2.PrefillResponse(
            first_token_id=out.new_token_ids[0], num_cached_tokens=out.num_cached_tokens
        )
        if out.new_logprobs:
            response.first_logprob.CopyFrom(logprobs_to_proto(out.new_logprobs[0]))
        if out.kv_handle is None:  # the first token already finished the request
            response.finish_reason = out.finish_reason
            return response
        if not context.is_active():  # the router left as the prefill finished: no one will pull
            self.loop.abort(request_id)
        response.kv_handle.CopyFrom(handle_to_proto(out.kv_handle, self.kv_address))
        return response

    def GetInfo(self, request, context):
        return worker_info(self.loop, "prefill")


def serve(args: argparse.Namespace) -> None:
    """Start the prefill worker, print its ready line, block until SIGINT/SIGTERM."""
    transfer = GrpcKVTransfer("prefill", lease_s=args.kv_lease_seconds)
    engine = Engine(engine_config(args, EngineRole.PREFILL), transfer)
    loop = EngineLoop(engine, "prefill")

    def expire_leases() -> None:  # nobody renewed them: the decode worker (or router) is gone
        for request_id in transfer.expire_leases():
            logger.warning("KV lease of %s lapsed: its blocks are freed", request_id)
            metrics.KV_TRANSFER_FAILURES.labels("prefill", "lease_expired").inc()

    loop.add_idle_hook(expire_leases)
    prefill = PrefillServicer(loop)
    kv = KVTransferServicer(
        transfer, loop.call, engine.kv_peer_info, stall_s=args.debug_kv_stall_seconds
    )
    service = start_service(
        "prefill",
        [
            (worker_pb2_grpc.add_PrefillServicer_to_server, prefill, "pdserve.v1.Prefill"),
            (add_kv_transfer_servicer, kv, "pdserve.v1.KVTransfer"),
            (worker_pb2_grpc.add_AdminServicer_to_server, AdminServicer(loop), "pdserve.v1.Admin"),
        ],
        args.host,
        args.port,
        args.metrics_port,
    )
    prefill.kv_address = service.grpc_address
    loop.start()
    publisher = None
    if args.redis_url:  # exact prefix index: this worker's cache events, under its address
        index = make_prefix_index(
            args.redis_url, engine.model_id, engine.config.block_size, args.index_ttl
        )
        publisher = KVEventPublisher(
            loop, index, service.grpc_address, heartbeat_s=args.index_ttl / 3
        )
        publisher.start()

    def stop() -> None:
        if publisher is not None:
            publisher.stop()
        loop.stop()
        transfer.close()

    print(service.ready_line(engine_id=engine.config.engine_id), flush=True)

    def drained() -> bool:  # nothing running, nothing pinned for a decode worker to pull
        return loop.call(lambda: not engine.has_unfinished_requests() and not engine.pinned)

    wait_for_termination(
        service,
        on_stop=stop,
        draining=prefill.draining,
        drained=drained,
        drain_timeout=args.drain_timeout,
    )
