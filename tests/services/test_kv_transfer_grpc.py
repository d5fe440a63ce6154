"""The gRPC KV-transfer path between a PREFILL and a DECODE engine, in one process over loopback."""

from __future__ import annotations

import time

import pytest
import torch

from services.common.convert import tensor_from_bytes, tensor_to_bytes
from services.common.kv_transfer_grpc import GrpcKVTransfer, KVTransferServicer
from services.common.pb import worker_pb2, worker_pb2_grpc
from services.common.server import start_service
from services.engine import EngineRole, SamplingParams
from services.engine.errors import KVHandshakeError, KVTransferError
from tests.engine.helpers import GREEDY, make_engine, run_to_completion


@pytest.fixture
def prefill_side(tiny_llama):
    """A PREFILL engine whose KVTransfer service streams chunks of at most 3 blocks."""
    transfer = GrpcKVTransfer("prefill")
    engine = make_engine(tiny_llama, role=EngineRole.PREFILL, num_blocks=256, block_size=4, kv_transfer=transfer)
    block_bytes = engine.kv_cache.spec.bytes_per_block
    # The test drives the engine itself, one call at a time, so the servicer may touch it directly.
    servicer = KVTransferServicer(transfer, lambda fn: fn(), engine.kv_peer_info, chunk_bytes=3 * block_bytes)
    service = start_service("prefill", [(worker_pb2_grpc.add_KVTransferServicer_to_server, servicer,
                                         "pdserve.v1.KVTransfer")], "127.0.0.1", 0, 0)
    yield engine, service.grpc_address, block_bytes
    service.server.stop(0)


def _wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def _prefill(engine, request_id: str, prompt: list[int]):
    engine.add_request(prompt, SamplingParams(max_tokens=8, **GREEDY), request_id=request_id)
    (out,) = engine.step()
    return out.kv_handle


def test_pull_streams_bounded_chunks_and_decodes_like_both(tiny_llama, prefill_side):
    prefill, address, block_bytes = prefill_side
    prompt = list(range(3, 40))  # 37 tokens -> 10 blocks of 4 -> 4 chunks of <= 3 blocks
    handle = _prefill(prefill, "r", prompt)
    stub = worker_pb2_grpc.KVTransferStub(__import__("grpc").insecure_channel(address))
    from services.common.convert import handle_to_proto

    chunks = list(stub.PullKV(worker_pb2.PullKVRequest(handle=handle_to_proto(handle, address))))
    assert [c.num_blocks for c in chunks] == [3, 3, 3, 1]
    assert all(len(c.data) <= 3 * block_bytes for c in chunks)
    assert chunks[0].HasField("layout") and not chunks[1].HasField("layout")

    transfer = GrpcKVTransfer("decode")
    decode = make_engine(tiny_llama, role=EngineRole.DECODE, num_blocks=256, block_size=4, kv_transfer=transfer)
    transfer.set_source("r", address)
    decode.add_request(prompt, SamplingParams(max_tokens=8, **GREEDY), request_id="r", kv_handle=handle)
    assert not decode.has_unfinished_requests()  # reserved: nothing to step until the KV is here
    assert decode.take_reserved() == [("r", 0)]
    transfer.prefetch(handle, 0)
    outs = {}
    while decode.has_unfinished_requests():
        for out in decode.step():
            outs[out.request_id] = out.output_token_ids
    assert decode.scheduler.num_prompt_tokens_computed == 0
    _wait_for(lambda: prefill.kv_cache.pool.num_used_blocks == 0)  # ReleaseKV (sent async) unpinned it
    both, _ = run_to_completion(make_engine(tiny_llama, num_blocks=256, block_size=4),
                                {"r": (prompt, SamplingParams(max_tokens=8, **GREEDY))})
    assert outs["r"] == both["r"]
    assert transfer.bytes_transferred == 10 * block_bytes


def test_pull_of_a_released_handle_fails_cleanly(tiny_llama, prefill_side):
    prefill, address, _ = prefill_side
    handle = _prefill(prefill, "gone", list(range(3, 20)))
    prefill.abort("gone")
    transfer = GrpcKVTransfer("decode", timeout_s=5)
    transfer.set_source("gone", address)
    with pytest.raises(KVTransferError, match="NOT_FOUND"):
        transfer.pull(handle)


def test_pull_from_a_dead_address_fails_within_the_timeout(tiny_llama, prefill_side):
    prefill, _, _ = prefill_side
    handle = _prefill(prefill, "x", list(range(3, 20)))
    transfer = GrpcKVTransfer("decode", timeout_s=2)
    transfer.set_source("x", "127.0.0.1:1")
    with pytest.raises(KVTransferError, match="UNAVAILABLE|DEADLINE_EXCEEDED"):
        transfer.pull(handle)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_tensor_bytes_round_trip(dtype):
    tensor = torch.randn(2, 2, 3, 4, 1, 8).to(dtype)
    again = tensor_from_bytes(tensor_to_bytes(tensor), dtype, tuple(tensor.shape))
    assert torch.equal(again, tensor)
    with pytest.raises(ValueError, match="kv chunk"):
        tensor_from_bytes(tensor_to_bytes(tensor)[:-2], dtype, tuple(tensor.shape))


def test_partial_pulls_skip_cached_blocks_and_refetch_what_was_evicted(tiny_llama, prefill_side):
    """first_block skips the blocks the destination's prefix cache holds; when the destination
    asks for fewer skipped blocks than it prefetched without (its cached block was evicted in
    between), the missing blocks are fetched at pull time, while the source still pins them."""
    prefill, address, block_bytes = prefill_side
    handle = _prefill(prefill, "p", list(range(3, 40)))  # 10 blocks of 4
    whole = prefill.read_kv(handle)
    transfer = GrpcKVTransfer("decode")
    transfer.set_source("p", address)
    transfer.prefetch(handle, first_block=6)
    assert transfer.bytes_transferred == 4 * block_bytes
    assert torch.equal(transfer.pull(handle, 7), whole[:, :, 7:])  # the prefetched copy, cut
    transfer.prefetch(handle, first_block=6)
    assert torch.equal(transfer.pull(handle, 2), whole[:, :, 2:])  # blocks 2..5 fetched now
    assert transfer.bytes_transferred == (4 + 4 + 8) * block_bytes
    transfer.prefetch(handle, first_block=10)  # every block cached: nothing to pull
    assert transfer.bytes_transferred == 16 * block_bytes
    transfer.complete(handle)
    _wait_for(lambda: prefill.kv_cache.pool.num_used_blocks == 0)


def _counter(name: str, **labels) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.mark.parametrize("overrides, field", [
    (dict(block_size=8), r"block_size: 4 at the source \(prefill\), 8 at the destination \(decode\)"),
    (dict(dtype="bfloat16"), r"dtype: float32 at the source \(prefill\), bfloat16 at the destination"),
])
def test_handshake_refuses_another_layout_on_both_sides(tiny_llama, prefill_side, overrides, field):
    prefill, address, _ = prefill_side
    handle = _prefill(prefill, "h", list(range(3, 20)))
    refused_before = _counter("pdserve_kv_transfer_failures_total", role="prefill", reason="handshake")
    transfer = GrpcKVTransfer("decode", timeout_s=5)
    decode = make_engine(tiny_llama, role=EngineRole.DECODE, num_blocks=64, kv_transfer=transfer,
                         **{"block_size": 4, **overrides})
    transfer.set_source("h", address)
    with pytest.raises(KVHandshakeError, match=field):
        decode.add_request(list(range(3, 20)), SamplingParams(max_tokens=4, **GREEDY), request_id="h", kv_handle=handle)
    # The source refused too (FAILED_PRECONDITION, counted), and was told to unpin.
    assert _counter("pdserve_kv_transfer_failures_total", role="prefill", reason="handshake") == refused_before + 1
    _wait_for(lambda: prefill.kv_cache.pool.num_used_blocks == 0)
    assert not decode.requests and decode.kv_cache.pool.num_used_blocks == 0
    transfer.close()


def test_the_destination_renews_leases_while_it_wants_the_kv(tiny_llama, prefill_side):
    """A 0.6 s lease stays alive for 2 s while the destination holds the request (renewals every
    0.2 s), and lapses within a lease once it lets go; late messages then change nothing."""
    prefill, address, _ = prefill_side
    prefill.kv_transfer.leases.lease_s = 0.6
    handle = _prefill(prefill, "kept", list(range(3, 20)))
    transfer = GrpcKVTransfer("decode", timeout_s=5)
    decode = make_engine(tiny_llama, role=EngineRole.DECODE, num_blocks=64, block_size=4, kv_transfer=transfer)
    transfer.set_source("kept", address)
    transfer.connect(handle, decode.kv_peer_info)  # learns the source's 0.6 s lease
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        assert prefill.kv_transfer.expire_leases() == []
        time.sleep(0.05)
    assert prefill.num_pinned_blocks == len(handle.block_ids)
    transfer.forget("kept")
    lapsed_at = time.monotonic() + 0.6 + 0.3
    while not prefill.kv_transfer.expire_leases():
        assert time.monotonic() < lapsed_at, "the lease did not lapse"
        time.sleep(0.02)
    assert prefill.num_pinned_blocks == 0
    stub = worker_pb2_grpc.KVTransferStub(__import__("grpc").insecure_channel(address))
    assert list(stub.RenewKVLease(worker_pb2.RenewKVLeaseRequest(request_ids=["kept", "never"])).renewed) == [False, False]
    assert not stub.ReleaseKV(worker_pb2.ReleaseKVRequest(request_id="kept")).released  # late: harmless
    transfer.close()
