"""The router's Admin service (services/router/admin.py): ResetPrefixCache fans out to every
worker and names the ones that did not answer."""

from __future__ import annotations

import grpc
import pytest

from services.common.pb import worker_pb2, worker_pb2_grpc


def test_router_reset_prefix_cache_names_the_workers_that_did_not_answer(cluster):
    """The fake prefill worker serves Admin, the fake decode worker does not: the reset goes on
    where it can and the caller learns which worker missed it."""
    channel = grpc.insecure_channel(cluster[0].service.grpc_address)
    with pytest.raises(grpc.RpcError) as failed:
        worker_pb2_grpc.AdminStub(channel).ResetPrefixCache(
            worker_pb2.ResetPrefixCacheRequest(), timeout=10
        )
    channel.close()
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    decode_address = cluster[0].flow.pool.decode[0]
    assert (
        "on 1 workers" in failed.value.details()
        and f"{decode_address} (UNIMPLEMENTED)" in failed.value.details()
    )
