"""The gRPC KV-transfer path between a PREFILL and a DECODE engine, in one process over loopback."""

from __future__ import annotations

import time

import pytest
import torch

from services.common.grpc_server import start_service
from services.common.pb import worker_pb2, worker_pb2_grpc
from services.engine import EngineRole, SamplingParams
from services.engine.errors import KVHandshakeError, KVTransferError
from services.kv_transfer.control.receiver import GrpcKVReceiver
from services.kv_transfer.control.service import KVTransferServicer, add_kv_transfer_servicer
from services.kv_transfer.sender import KVSender
from tests.engine.helpers import GREEDY, make_engine, run_to_completion


@pytest.fixture
def prefill_side(tiny_llama):
    """A PREFILL engine whose KVTransfer service streams chunks of at most 3 blocks."""
    sender = KVSender()
    engine = make_engine(
        tiny_llama, role=EngineRole.PREFILL, num_blocks=256, block_size=4, kv_sender=sender
    )
    block_bytes = engine.kv_cache.spec.bytes_per_block
    # The test drives the engine itself, one call at a time, so the servicer may touch it directly.
    servicer = KVTransferServicer(
        sender, lambda fn: fn(), engine.kv_peer_info, chunk_bytes=3 * block_bytes
    )
    service = start_service(
        "prefill",
        [(add_kv_transfer_servicer, servicer, "pdserve.v1.KVTransfer")],
        "127.0.0.1",
        0,
        0,
    )
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

    transfer = GrpcKVReceiver()
    decode = make_engine(
        tiny_llama, role=EngineRole.DECODE, num_blocks=256, block_size=4, kv_receiver=transfer
    )
    transfer.set_source("r", address)
    decode.add_request(
        prompt, SamplingParams(max_tokens=8, **GREEDY), request_id="r", kv_handle=handle
    )
    assert not decode.has_unfinished_requests()  # reserved: nothing to step until the KV is here
    (reserved,) = decode.take_reserved(claim_writes=True)  # as the decode worker: write, then tell
    for offset, piece in transfer.pull_chunks(handle, reserved.first_block):
        decode.kv_cache.write_blocks(
            list(reserved.block_ids[offset : offset + piece.shape[2]]), piece
        )
    decode.kv_written("r", ok=True)
    outs = {}
    while decode.has_unfinished_requests():
        for out in decode.step():
            outs[out.request_id] = out.output_token_ids
    assert decode.scheduler.num_prompt_tokens_computed == 0
    _wait_for(
        lambda: prefill.kv_cache.pool.num_used_blocks == 0
    )  # ReleaseKV (sent async) unpinned it
    both, _ = run_to_completion(
        make_engine(tiny_llama, num_blocks=256, block_size=4),
        {"r": (prompt, SamplingParams(max_tokens=8, **GREEDY))},
    )
    assert outs["r"] == both["r"]
    assert transfer.bytes_transferred == 10 * block_bytes


def test_pull_of_a_released_handle_fails_cleanly(tiny_llama, prefill_side):
    prefill, address, _ = prefill_side
    handle = _prefill(prefill, "gone", list(range(3, 20)))
    prefill.abort("gone")
    transfer = GrpcKVReceiver(timeout_s=5)
    transfer.set_source("gone", address)
    with pytest.raises(KVTransferError, match="NOT_FOUND"):
        transfer.pull(handle)


def test_pull_from_a_dead_address_fails_within_the_timeout(tiny_llama, prefill_side):
    prefill, _, _ = prefill_side
    handle = _prefill(prefill, "x", list(range(3, 20)))
    transfer = GrpcKVReceiver(timeout_s=2)
    transfer.set_source("x", "127.0.0.1:1")
    with pytest.raises(KVTransferError, match="UNAVAILABLE|DEADLINE_EXCEEDED"):
        transfer.pull(handle)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_chunks_are_protobuf_on_the_wire_and_views_on_arrival(dtype):
    """`encode_chunk` writes what protobuf writes; `decode_chunk` reads what protobuf writes; the
    KV arrives as a view of the received bytes, equal to the cache's blocks bit for bit."""
    from services.common.pb import common_pb2
    from services.engine.kv_cache import KVCache, KVCacheSpec
    from services.kv_transfer.grpc.wire import chunk_tensor, decode_chunk, encode_chunk

    cache = KVCache(KVCacheSpec(2, 1, 8, 4, dtype), 16, "cpu")
    cache.kv.copy_(torch.randn(cache.kv.shape).to(dtype))
    blocks = [5, 6, 7, 2, 9]  # runs 5-7, 2, 9
    layout = common_pb2.KVLayout(
        num_layers=2, num_kv_heads=1, head_dim=8, block_size=4, dtype="x", layout="y"
    )
    raw = encode_chunk(3, 5, layout, cache.block_buffers(blocks))
    want = cache.read_blocks(blocks)
    proto = worker_pb2.KVChunk.FromString(raw)
    assert (proto.block_offset, proto.num_blocks, proto.layout) == (3, 5, layout)
    assert (
        raw
        == worker_pb2.KVChunk(
            layout=layout, block_offset=3, num_blocks=5, data=proto.data
        ).SerializeToString()
    )
    header, data = decode_chunk(raw)
    assert (header.block_offset, header.num_blocks, header.layout) == (3, 5, layout)
    assert torch.equal(chunk_tensor(data, dtype, tuple(want.shape)), want)
    header, _ = decode_chunk(worker_pb2.KVChunk(block_offset=7, num_blocks=1).SerializeToString())
    assert (header.block_offset, header.num_blocks, header.layout) == (7, 1, None)
    with pytest.raises(ValueError, match="truncated"):
        decode_chunk(raw[:-3])
    with pytest.raises(KVTransferError, match="do not fill"):
        chunk_tensor(data[:-2], dtype, tuple(want.shape))


def test_partial_pulls_skip_cached_blocks(tiny_llama, prefill_side):
    """first_block skips the blocks the destination's prefix cache holds; chunks arrive in order
    with their offsets; a pull of no blocks sends nothing."""
    prefill, address, block_bytes = prefill_side
    handle = _prefill(prefill, "p", list(range(3, 40)))  # 10 blocks of 4, chunks of 3
    whole = prefill.export.read_kv(handle)
    transfer = GrpcKVReceiver()
    transfer.set_source("p", address)
    chunks = list(transfer.pull_chunks(handle, first_block=6))
    assert [(offset, piece.shape[2]) for offset, piece in chunks] == [(0, 3), (3, 1)]
    assert torch.equal(torch.cat([piece for _, piece in chunks], dim=2), whole[:, :, 6:])
    assert torch.equal(torch.cat(transfer.pull(handle, 2), dim=2), whole[:, :, 2:])
    assert transfer.bytes_transferred == (4 + 8) * block_bytes
    assert list(transfer.pull_chunks(handle, first_block=10)) == []  # every block cached
    transfer.complete(handle)
    _wait_for(lambda: prefill.kv_cache.pool.num_used_blocks == 0)


def _counter(name: str, **labels) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.mark.parametrize(
    "overrides, field",
    [
        (
            dict(block_size=8),
            r"block_size: 4 at the source \(prefill\), 8 at the destination \(decode\)",
        ),
        (
            dict(dtype="bfloat16"),
            r"dtype: float32 at the source \(prefill\), bfloat16 at the destination",
        ),
    ],
)
def test_handshake_refuses_another_layout_on_both_sides(tiny_llama, prefill_side, overrides, field):
    prefill, address, _ = prefill_side
    handle = _prefill(prefill, "h", list(range(3, 20)))
    refused_before = _counter(
        "pdserve_kv_transfer_failures_total", role="prefill", reason="handshake"
    )
    transfer = GrpcKVReceiver(timeout_s=5)
    decode = make_engine(
        tiny_llama,
        role=EngineRole.DECODE,
        num_blocks=64,
        kv_receiver=transfer,
        **{"block_size": 4, **overrides},
    )
    transfer.set_source("h", address)
    with pytest.raises(KVHandshakeError, match=field):
        decode.add_request(
            list(range(3, 20)),
            SamplingParams(max_tokens=4, **GREEDY),
            request_id="h",
            kv_handle=handle,
        )
    # The source refused too (FAILED_PRECONDITION, counted), and was told to unpin.
    assert (
        _counter("pdserve_kv_transfer_failures_total", role="prefill", reason="handshake")
        == refused_before + 1
    )
    _wait_for(lambda: prefill.kv_cache.pool.num_used_blocks == 0)
    assert not decode.requests and decode.kv_cache.pool.num_used_blocks == 0
    transfer.close()


def test_the_destination_renews_leases_while_it_wants_the_kv(tiny_llama, prefill_side):
    """A 1.5 s lease stays alive for 2 s while the destination holds the request (renewals every
    0.5 s, so a renewal may be 1 s late on a busy machine), and lapses within a lease once it
    lets go; late messages then change nothing."""
    prefill, address, _ = prefill_side
    prefill.kv_sender.leases.lease_s = 1.5
    handle = _prefill(prefill, "kept", list(range(3, 20)))
    transfer = GrpcKVReceiver(timeout_s=5)
    decode = make_engine(
        tiny_llama, role=EngineRole.DECODE, num_blocks=64, block_size=4, kv_receiver=transfer
    )
    transfer.set_source("kept", address)
    transfer.connect(handle, decode.kv_peer_info)  # learns the source's 1.5 s lease
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        assert prefill.kv_sender.expire_leases() == []
        time.sleep(0.05)
    assert prefill.num_pinned_blocks == len(handle.block_ids)
    transfer.forget("kept")
    lapsed_at = time.monotonic() + 1.5 + 0.5
    while not prefill.kv_sender.expire_leases():
        assert time.monotonic() < lapsed_at, "the lease did not lapse"
        time.sleep(0.02)
    assert prefill.num_pinned_blocks == 0
    stub = worker_pb2_grpc.KVTransferStub(__import__("grpc").insecure_channel(address))
    assert list(
        stub.RenewKVLease(worker_pb2.RenewKVLeaseRequest(request_ids=["kept", "never"])).renewed
    ) == [False, False]
    assert not stub.ReleaseKV(
        worker_pb2.ReleaseKVRequest(request_id="kept")
    ).released  # late: harmless
    transfer.close()
