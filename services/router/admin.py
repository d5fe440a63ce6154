"""The router's `Admin` service: each operator call is applied to every worker it routes to."""

from __future__ import annotations

import grpc

from services.common.errors import ServiceUnavailableError
from services.common.pb import worker_pb2, worker_pb2_grpc
from services.router.workers import WorkerPool

ADMIN_TIMEOUT_S = 30.0


class RouterAdminServicer(worker_pb2_grpc.AdminServicer):
    """Fans `ResetPrefixCache` out to every prefill and decode worker and sums their replies.

    Raises ServiceUnavailableError (-> UNAVAILABLE) naming the workers that did not answer; the
    others are reset all the same.
    """

    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool

    def ResetPrefixCache(self, request, context):
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
