"""What the prefill and decode worker processes share: info, the admin service, waiting for
outputs, and cache salts from the wire."""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import grpc

from services.common.convert import layout_to_proto
from services.common.grpc_server import RunningService, drain_and_stop, wait_for_termination
from services.common.member_leases import Member, Registrar
from services.common.pb import common_pb2, worker_pb2, worker_pb2_grpc
from services.config.handoff import to_json
from services.config.roles import WorkerConfig
from services.engine.config import EngineConfig
from services.engine.errors import InvalidRequestError
from services.engine.outputs import RequestOutput
from services.worker.core_lending import open_lending
from services.worker.cpus import format_cpus
from services.worker.engine_loop import EngineLoop
from services.worker.step_cost import saved_costs_json

W = TypeVar("W", bound=WorkerConfig)

_POLL_SECONDS = 0.05
WARM_UP_TIMEOUT_S = 600.0  # a big model's first forwards on a slow CPU; the launcher waits 120 s
REGISTER_TIMEOUT_S = 5.0
logger = logging.getLogger(__name__)


def effective_config(config: W, engine: EngineConfig, service: RunningService) -> W:
    """What a started worker runs with: its engine's resolved config (role, max_model_len,
    events), the ports it bound, its torch threads and the CPUs it may run on."""
    import torch  # loaded already: the engine runs on it

    return dataclasses.replace(
        config,
        engine=engine,
        port=service.port,
        metrics_port=service.metrics_port,
        threads=config.threads or torch.get_num_threads(),
        cpus=format_cpus(sorted(os.sched_getaffinity(0))),
    )


def worker_info(loop: EngineLoop, config: WorkerConfig) -> common_pb2.WorkerInfo:
    """A snapshot of the worker's engine, taken on the engine thread; `config`: the effective
    one (`effective_config`)."""

    def snapshot() -> common_pb2.WorkerInfo:
        engine = loop.engine
        pool = engine.kv_cache.pool
        return common_pb2.WorkerInfo(
            role=config.role.value,
            config_json=to_json(config),
            engine_id=engine.config.engine_id,
            model=engine.config.model,
            kv_layout=layout_to_proto(engine.kv_cache.spec),
            max_model_len=engine.config.max_model_len,
            vocab_size=engine.runner.vocab_size,
            num_blocks=pool.num_blocks,
            num_free_blocks=pool.num_free_blocks,
            num_pinned_blocks=engine.num_pinned_blocks,
            num_running=engine.scheduler.num_running,
            num_waiting=engine.num_waiting,
            num_prompt_tokens_computed=engine.scheduler.num_prompt_tokens_computed,
            max_step_tokens_per_request=loop.max_step_tokens_per_request,
            num_cached_blocks=pool.num_cached_blocks,
            model_id=engine.model_id,
            prefix_cache_queries=engine.scheduler.prefix_cache_queries,
            prefix_cache_hits=engine.scheduler.prefix_cache_hits,
            step_costs_json=saved_costs_json(engine),
        )

    return loop.call(snapshot)


class AdminServicer(worker_pb2_grpc.AdminServicer):
    """`Admin` on a worker: operator controls applied on the engine thread."""

    def __init__(self, loop: EngineLoop, config: WorkerConfig) -> None:
        self.loop = loop
        self.config = config

    def GetInfo(self, request, context):  # noqa: N802 - gRPC method name
        return worker_info(self.loop, self.config)

    def ListWorkers(self, request, context):  # noqa: N802 - gRPC method name
        """Only a router lists workers (`pdserve status --url` names a worker here)."""
        raise InvalidRequestError(
            "url", f"this is a {self.config.role.value} worker; pass the router's address"
        )

    def RegisterWorker(self, request, context):  # noqa: N802 - gRPC method name
        """Only a router has a pool to join."""
        raise InvalidRequestError(
            "register_with", f"this is a {self.config.role.value} worker, not a router"
        )

    def ResetPrefixCache(self, request, context):
        cleared = self.loop.call(self.loop.engine.reset_prefix_cache)
        return worker_pb2.ResetPrefixCacheResponse(num_workers=1, num_hashes_dropped=cleared)


def cache_salt(value: str) -> str | None:
    """The engine's salt for a wire `cache_salt` field (empty means none)."""
    return value or None


def next_output(stream: queue.Queue, context: grpc.ServicerContext) -> RequestOutput | None:
    """The request's next output; None once the caller has cancelled or its deadline passed.

    Raises the exception the engine loop put on the stream (a failed step).
    """
    while context.is_active():
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:
            return None
        try:
            item = stream.get(timeout=_POLL_SECONDS)
        except queue.Empty:
            continue
        if isinstance(item, BaseException):
            raise item
        return item
    return None


@dataclass
class RunningWorker:
    """A started worker: its gRPC service and engine loop, and how to drain and close it."""

    service: RunningService
    loop: EngineLoop
    draining: threading.Event  # set on SIGTERM: the servicers refuse new requests
    drained: Callable[[], bool]  # nothing left that a peer still needs from this worker
    close: Callable[[], None]  # stops the engine loop and the worker's threads
    registrars: list[Registrar] = field(default_factory=list)  # one per router it joined

    def join(self, member: Member, register: Callable[[Member, bool], float], to: str) -> None:
        """Register with a router (or a registry) through `register` and keep renewing until
        the worker stops (`Registrar`); raises what the first call raises."""
        registrar = Registrar(member, register, description=to)
        registrar.start()
        self.registrars.append(registrar)

    def join_routers(self, routers: tuple[str, ...]) -> None:
        """`--register-with`: join each router's pool over gRPC (Admin.RegisterWorker). On
        failure the worker stops and the error (naming the router) is raised."""
        member = Member(self.loop.role, self.service.grpc_address, self.service.metrics_url)
        try:
            for router in routers:
                self.join(member, _grpc_register(router), f"router {router}")
        except grpc.RpcError as exc:
            self.stop(grace=0)
            raise ConnectionError(
                f"register_with: router {router} refused or did not answer "
                f"({exc.code().name}: {exc.details()})"
            ) from None

    def shutdown(self) -> None:
        """Leave every router's pool, then close (after the drain)."""
        for registrar in self.registrars:
            registrar.stop(leave=True)
        self.close()

    def warm_up_and_serve(
        self, then: Callable[[], object] | None = None, core_ledger: str | None = None
    ) -> float:
        """Run the engine's warm-up (`Engine.warm_up`) on the engine thread, the thread whose
        OpenMP team and caches then serve, and only then turn health SERVING (`start_*` call it
        before they return, so the ready line follows it). Calls that arrive meanwhile wait for
        it on the engine thread. Returns its seconds. On failure (its exception, or TimeoutError
        after WARM_UP_TIMEOUT_S) it stops the worker and re-raises. `then` runs next on the engine
        thread, still before SERVING (a decode worker's cost model). With `core_ledger` (the
        worker's `--core-ledger`), core lending starts last (`core_lending.py`)."""
        try:
            seconds = self.loop.call(self.loop.engine.warm_up, timeout=WARM_UP_TIMEOUT_S)
            if then is not None:
                self.loop.call(then, timeout=WARM_UP_TIMEOUT_S)
            if core_ledger is not None:
                lending = self.loop.call(
                    lambda: open_lending(core_ledger, self.loop.engine, self.loop.role)
                )
                self.loop.start_lending(lending)
        except BaseException:
            self.stop(grace=0)
            raise
        logger.info("%s engine warmed up in %.3f s", self.loop.role, seconds)
        self.service.set_serving()
        return seconds

    def ready_line(self) -> str:
        """`ready {json}` with role, grpc, metrics, pid and engine_id."""
        return self.service.ready_line(engine_id=self.loop.engine.config.engine_id)

    def serve_forever(self, drain_timeout: float) -> None:
        """Print the ready line, block until SIGINT/SIGTERM, drain, close."""
        print(self.ready_line(), flush=True)
        wait_for_termination(
            self.service,
            on_stop=self.shutdown,
            draining=self.draining,
            drained=self.drained,
            drain_timeout=drain_timeout,
        )

    def drain_and_stop(self, drain_timeout: float) -> None:
        """What SIGTERM does, without the signal (a Ray replica that Serve stops): refuse new
        requests, finish those in flight for up to `drain_timeout` seconds, leave, close."""
        drain_and_stop(
            self.service,
            on_stop=self.shutdown,
            draining=self.draining,
            drained=self.drained,
            drain_timeout=drain_timeout,
        )

    def stop(self, grace: float = 1.0) -> None:
        """Stop serving and close (tests, in-process deployments)."""
        self.service.server.stop(grace).wait()
        self.shutdown()


def _grpc_register(router: str) -> Callable[[Member, bool], float]:
    """The transport of `--register-with`: Admin.RegisterWorker on `router` (its API key, if
    any, from $PDSERVE_API_KEY), returning the ttl it grants."""
    from services import env
    from services.common.channels import CHANNEL_OPTIONS

    stub = worker_pb2_grpc.AdminStub(grpc.insecure_channel(router, options=CHANNEL_OPTIONS))
    key = env.api_key()
    metadata = [("authorization", f"Bearer {key}")] if key else None

    def register(member: Member, leave: bool) -> float:
        request = worker_pb2.RegisterWorkerRequest(
            role=member.role,
            address=member.address,
            metrics_url=member.metrics_url,
            name=member.name,
            leave=leave,
        )
        reply = stub.RegisterWorker(request, timeout=REGISTER_TIMEOUT_S, metadata=metadata)
        return reply.ttl_seconds

    return register
