"""The router's `Admin` service: its own info, and operator calls applied to every worker."""

from __future__ import annotations

import dataclasses

import grpc

from services.common.errors import InvalidRequestError, ServiceUnavailableError
from services.common.member_leases import WORKER_ROLES, Member
from services.common.pb import common_pb2, worker_pb2, worker_pb2_grpc
from services.config.handoff import to_json
from services.config.roles import RouterConfig
from services.router.api_key import REDACTED, check_metadata
from services.router.flow.prompt import ModelInfo
from services.router.pool.registration import RouterMembership
from services.router.pool.worker_pool import WorkerPool

ADMIN_TIMEOUT_S = 30.0
LIST_TIMEOUT_S = 5.0


class RouterAdminServicer(worker_pb2_grpc.AdminServicer):
    """`GetInfo`: the router's role, model and config. `ResetPrefixCache`: fanned out to every
    prefill and decode worker, their replies summed; raises ServiceUnavailableError
    (-> UNAVAILABLE) naming the workers that did not answer (the others are reset all the same).
    With an API key, both want it (UnauthenticatedError otherwise), as Generate does.
    """

    def __init__(
        self,
        pool: WorkerPool,
        config: RouterConfig,
        model: ModelInfo,
        membership: RouterMembership,
    ) -> None:
        self.pool = pool
        self.membership = membership
        self._key = config.api_key.encode() if config.api_key else None
        self.info = common_pb2.WorkerInfo(
            role="router",
            model=config.model,
            max_model_len=model.max_model_len,
            vocab_size=model.vocab_size,
        )
        self.set_config(config)

    def set_config(self, config: RouterConfig) -> None:
        """The effective config (bound ports), reported by GetInfo (its API key redacted)."""
        redacted = REDACTED if config.api_key else None
        self.info.config_json = to_json(dataclasses.replace(config, api_key=redacted))

    def GetInfo(self, request, context):  # noqa: N802 - gRPC method name
        check_metadata(context.invocation_metadata(), self._key)
        return self.info

    def ListWorkers(self, request, context):  # noqa: N802 - gRPC method name
        """Every worker with the router's health view and its GetInfo, asked in parallel (a
        worker that does not answer within a few seconds is listed with its error)."""
        check_metadata(context.invocation_metadata(), self._key)
        timeout = min(LIST_TIMEOUT_S, context.time_remaining() or LIST_TIMEOUT_S)
        roles = {a: "prefill" for a in self.pool.prefill} | {a: "decode" for a in self.pool.decode}
        futures = {
            address: worker_pb2_grpc.AdminStub(self.pool.channel(address)).GetInfo.future(
                common_pb2.InfoRequest(), timeout=timeout
            )
            for address in roles
        }
        listed = worker_pb2.WorkerList()
        for address, future in futures.items():
            status = listed.workers.add(
                role=roles[address], address=address, healthy=address not in self.pool.unhealthy
            )
            try:
                status.info.CopyFrom(future.result())
            except grpc.RpcError as exc:
                status.error = f"{exc.code().name}: {exc.details()}"
        return listed

    def RegisterWorker(self, request, context):  # noqa: N802 - gRPC method name
        """A worker joins, renews or leaves the pool (`RouterMembership`); INVALID_ARGUMENT
        names a bad role or address. Wants the API key when the router has one."""
        check_metadata(context.invocation_metadata(), self._key)
        if request.role not in WORKER_ROLES:
            raise InvalidRequestError(
                "role", f"expected one of {list(WORKER_ROLES)}, got {request.role!r}"
            )
        try:
            member = Member(request.role, request.address, request.metrics_url, request.name)
        except ValueError as exc:
            field, _, message = str(exc).partition(": ")
            raise InvalidRequestError(field, message) from None
        ttl = self.membership.register(member, leave=request.leave)
        return worker_pb2.RegisterWorkerResponse(ttl_seconds=ttl)

    def ResetPrefixCache(self, request, context):  # noqa: N802 - gRPC method name
        check_metadata(context.invocation_metadata(), self._key)
        timeout = min(ADMIN_TIMEOUT_S, context.time_remaining() or ADMIN_TIMEOUT_S)
        futures = {
            address: worker_pb2_grpc.AdminStub(self.pool.channel(address)).ResetPrefixCache.future(
                worker_pb2.ResetPrefixCacheRequest(), timeout=timeout
            )
            for address in self.pool.addresses
        }
        total = worker_pb2.ResetPrefixCacheResponse()
        failed = []
        for address, future in futures.items():
            try:
                reply = future.result()
            except grpc.RpcError as exc:
                failed.append(f"{address} ({exc.code().name})")
                continue
            total.num_workers += reply.num_workers
            total.num_hashes_dropped += reply.num_hashes_dropped
        if failed:
            raise ServiceUnavailableError(
                f"prefix cache reset on {total.num_workers} workers; not on {', '.join(failed)}"
            )
        return total
