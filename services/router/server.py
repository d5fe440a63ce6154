"""The router process: the public `Generation` gRPC service (+ optional OpenAI HTTP API).

`serve(config)` starts it from a `RouterConfig`, prints one `ready {json}` line once requests are
accepted, and blocks until SIGINT/SIGTERM. `start_router(config)` does the same without printing
or blocking (tests, the Ray deployment).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import grpc

from services.common import request_id
from services.common.errors import UnauthenticatedError, status_for
from services.common.grpc_server import RunningService, start_service, wait_for_termination
from services.common.pb import generate_pb2, generate_pb2_grpc, worker_pb2_grpc
from services.config.roles import API_KEY_ENV, RouterConfig
from services.router.admin import RouterAdminServicer
from services.router.api_key import check_metadata
from services.router.convert import output_to_proto, request_from_proto
from services.router.flow.cancel import CancelScope
from services.router.flow.generate import GenerateFlow
from services.router.flow.prompt import ModelInfo
from services.router.flow.request_stats import count_error
from services.router.openai.app import OpenAIApp
from services.router.openai.http_server import HttpServer
from services.router.pool.registration import RouterMembership
from services.router.pool.routing import Routing
from services.router.pool.worker_pool import WorkerPool

ROUTER_MAX_STREAMS = 1024  # concurrent Generate streams (one thread each)
SERVICE_NAME = "pdserve.v1.Generation"
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
logger = logging.getLogger(__name__)


class GenerationServicer(generate_pb2_grpc.GenerationServicer):
    """`Generation.Generate` over `GenerateFlow`: converts the request into the flow's
    `GenerationRequest` and its outputs back into messages (`router/convert.py`). The client's
    deadline (or the router's request_timeout when it set none) bounds every downstream call,
    and a client cancel cancels the in-flight downstream call at once."""

    def __init__(self, flow: GenerateFlow, api_key: str | None = None) -> None:
        self.flow = flow
        self._key = api_key.encode() if api_key else None

    def Generate(  # noqa: N802 - gRPC method name
        self, request: generate_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[generate_pb2.GenerateResponse]:
        # The call's id: x-request-id metadata, else the request's own request_id field, else
        # the fresh one the ErrorInterceptor bound; an unusable one is replaced.
        metadata = context.invocation_metadata()
        rid = (
            request_id.from_metadata(metadata)
            or request_id.accept(request.request_id)
            or request_id.current.get()
            or request_id.new_request_id()
        )
        context.send_initial_metadata(request_id.metadata(rid))  # the client learns its id
        with request_id.bound(rid):
            try:
                check_metadata(metadata, self._key)
                # the workers' per-sequence ids start with rid
                generation = request_from_proto(request, rid)
            except (UnauthenticatedError, ValueError) as exc:
                count_error(status_for(exc)[0])  # refused before any flow: counted here
                raise
        deadline = self.flow.deadline_for(context.time_remaining())
        scope = CancelScope()
        # Runs when the RPC ends for any reason: cancel, deadline, or normal completion (no-op).
        if not context.add_callback(scope.cancel):
            scope.cancel()  # the RPC is already over
        outputs = request_id.bind_stream(self.flow.generate(generation, deadline, scope), rid)
        try:
            for output in outputs:
                yield output_to_proto(output)
        finally:
            outputs.close()  # a client gone mid-stream ends the flow (and its calls) now


@dataclass
class RunningRouter:
    """A started router: gRPC service, request flow, optional HTTP API."""

    service: RunningService
    flow: GenerateFlow
    http: HttpServer | None
    membership: RouterMembership
    app: OpenAIApp | None = None

    def ready_line(self) -> str:
        """`ready {json}` with role, grpc, metrics, pid (and http when served)."""
        return self.service.ready_line(**({"http": self.http.url} if self.http else {}))

    def close(self) -> None:
        """Stops the HTTP API and closes worker channels (the caller stops the gRPC server)."""
        if self.http is not None:
            if self.app is not None:
                self.app.begin_shutdown(self.http.shutdown_timeout)
            self.http.close()  # lets running streams finish (http.shutdown_timeout)
        if self.app is not None:
            self.app.close()
        self.membership.close()
        self.flow.close()
        self.flow.pool.close()

    def stop(self, grace: float = 1.0) -> None:
        """Stops everything (tests)."""
        self.service.server.stop(grace).wait()
        self.close()


def build_flow(config: RouterConfig, dynamic: bool = False) -> GenerateFlow:
    """Model info, worker pool and flow of a router (`dynamic`: its workers register at run
    time, so an empty pool is expected). ValueError names a bad field."""
    model = ModelInfo.load(config.model, config.max_model_len)
    pool = WorkerPool(config.prefill, config.decode, dynamic=dynamic)
    routing = Routing(pool, config.routing, config.index.redis_url, config.index.index_ttl)
    return GenerateFlow(
        model,
        pool,
        config.request_timeout,
        routing,
        config.max_queued_requests,
        config.disaggregation,
        config.max_local_prefill_tokens,
        config.migration,
        config.slo_ttft_ms,
    )


def start_router(config: RouterConfig, dynamic: bool = False) -> RunningRouter:
    """Starts the router `config` describes and returns once it accepts requests (what `serve`,
    the tests and the Ray deployment call).

    Workers in `config.prefill` / `config.decode` stay; others join and leave through
    `Admin.RegisterWorker` or `RunningRouter.membership.follow` (`dynamic`: expect that, so an
    empty pool is no warning). Raises ValueError for a bad field, OSError naming the port that
    cannot be bound.
    """
    flow = build_flow(config, dynamic)
    servicer = GenerationServicer(flow, config.api_key)
    membership = RouterMembership(flow.pool, config.registration_ttl)
    admin = RouterAdminServicer(flow.pool, config, flow.model, membership)
    try:
        service = start_service(
            "router",
            [
                (generate_pb2_grpc.add_GenerationServicer_to_server, servicer, SERVICE_NAME),
                (worker_pb2_grpc.add_AdminServicer_to_server, admin, "pdserve.v1.Admin"),
            ],
            config.host,
            config.port,
            config.metrics_port,
            max_workers=ROUTER_MAX_STREAMS,
            new_request_ids=True,
            max_concurrent_rpcs=config.max_concurrent_rpcs,
        )
    except OSError:
        flow.pool.close()
        raise
    flow.pool.start_health_checks()
    flow.start()
    membership.start()
    http, app = None, None
    if config.http_port is not None:
        app = OpenAIApp(flow, config)
        try:
            http = HttpServer(app, config.host, config.http_port, config.http)
        except OSError:
            service.server.stop(0)
            membership.close()
            flow.pool.close()
            raise
    warn_if_open(config)
    admin.set_config(effective_router_config(config, service, http, flow.model.max_model_len))
    return RunningRouter(service, flow, http, membership, app)


def effective_router_config(
    config: RouterConfig, service: RunningService, http: HttpServer | None, max_model_len: int
) -> RouterConfig:
    """What a started router runs with: the ports it bound and the resolved max_model_len."""
    return dataclasses.replace(
        config,
        port=service.port,
        metrics_port=service.metrics_port,
        http_port=http.port if http else None,
        max_model_len=max_model_len,
    )


def warn_if_open(config: RouterConfig) -> bool:
    """Logs a warning (and returns True) when the router binds beyond loopback without a key."""
    if config.api_key is not None or config.host in LOOPBACK_HOSTS:
        return False
    logger.warning(
        "the router binds %s without an API key: anyone who reaches it can use it "
        "(set --api-key or %s)",
        config.host,
        API_KEY_ENV,
    )
    return True


def serve(config: RouterConfig) -> None:
    """Runs the router until SIGINT/SIGTERM. Prints exactly one line, `ready {json}`, to stdout
    once requests are accepted."""
    router = start_router(config)
    print(router.ready_line(), flush=True)
    flow = router.flow
    wait_for_termination(
        router.service,
        on_stop=router.close,
        draining=flow.stopping,
        drained=lambda: flow.num_active == 0,
        drain_timeout=config.http.shutdown_timeout,
        before_stop=flow.end_all,
    )
