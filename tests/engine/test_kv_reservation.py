"""Decode-side flow control: blocks are reserved before the KV moves, requests without room wait
in a bounded queue, and a request whose KV never comes times out and frees everything."""

from __future__ import annotations

import pytest

from services.engine import EngineRole, SamplingParams
from services.engine.errors import ResourceExhaustedError
from services.kv_transfer.in_memory import InMemoryKVReceiver, InMemoryKVTransfer
from services.kv_transfer.lease import TransferStatus
from tests.engine.helpers import GREEDY, make_engine
from tests.kv_transfer.test_lease import FakeClock


class GatedReceiver(InMemoryKVReceiver):
    """In-memory receiver whose KV is "on the wire" until the test opens the gate for it."""

    def __init__(self, sender) -> None:
        super().__init__(sender)
        self.arrived: set[str] = set()

    def is_ready(self, handle) -> bool:
        return handle.request_id in self.arrived


class GatedTransfer(InMemoryKVTransfer):
    def __init__(self) -> None:
        super().__init__()
        self.receiver = GatedReceiver(self.sender)


@pytest.fixture
def pair(tiny_llama):
    """A roomy PREFILL engine and a DECODE engine of 10 blocks (16 tokens each), at most 2 queued
    for blocks, 5 s to get the KV, on a fake clock."""
    transfer = GatedTransfer()
    prefill = make_engine(tiny_llama, role=EngineRole.PREFILL, num_blocks=128, kv_transfer=transfer)
    decode = make_engine(
        tiny_llama,
        role=EngineRole.DECODE,
        num_blocks=10,
        kv_transfer=transfer,
        max_num_waiting_for_kv=2,
        kv_transfer_timeout_s=5.0,
    )
    clock = FakeClock()
    decode.reservations.clock = clock
    return prefill, decode, transfer, clock


def _handoff(prefill, decode, rid: str, start: int | None = None):
    """Prefill `rid` and add it to the decode engine (60 prompt tokens + 1: 4 blocks); prompts
    differ by request id unless `start` is given."""
    start = start if start is not None else 3 + 100 * (sum(map(ord, rid)) % 4)
    prompt = list(range(start, start + 60))
    params = SamplingParams(max_tokens=6, **GREEDY)
    prefill.add_request(prompt, params, request_id=rid)
    (out,) = prefill.step()
    decode.add_request(prompt, params, request_id=rid, kv_handle=out.kv_handle)
    return out.kv_handle


def test_blocks_are_reserved_before_the_kv_arrives_and_the_queue_is_bounded(pair):
    prefill, decode, transfer, _ = pair
    pool = decode.kv_cache.pool
    _handoff(prefill, decode, "a")
    _handoff(prefill, decode, "b")
    assert _reserved(decode) == [("a", 0), ("b", 0)]
    assert pool.num_free_blocks == 2  # 4 + 4 reserved for KV that has not arrived
    assert not decode.has_unfinished_requests()  # nothing to step until a KV is ready
    _handoff(prefill, decode, "c")
    _handoff(prefill, decode, "d")  # no room: both wait for blocks
    assert _reserved(decode) == [] and decode.num_waiting_for_kv == 4
    with pytest.raises(ResourceExhaustedError, match="max_num_waiting_for_kv"):
        _handoff(prefill, decode, "e")
    assert "e" not in decode.requests
    prefill.abort("e")
    transfer.receiver.arrived.add("a")  # a's KV lands: it runs to the end and frees its blocks
    tokens = _run(decode)
    assert list(tokens) == ["a"] and len(tokens["a"]) == 6
    assert _reserved(decode) == [("c", 0)]  # first come, first served
    decode.abort("b")
    assert _reserved(decode) == [("d", 0)]
    for rid in ("c", "d"):
        transfer.receiver.arrived.add(rid)
    assert set(_run(decode)) == {"c", "d"}
    assert pool.num_free_blocks == 10 and prefill.num_pinned_blocks == 0
    decode.check_integrity()


def test_kv_that_never_arrives_times_out_and_frees_everything(pair):
    prefill, decode, transfer, clock = pair
    handle = _handoff(prefill, decode, "slow")
    _handoff(prefill, decode, "slow2")
    _handoff(prefill, decode, "queued")  # waits for blocks behind them
    assert _reserved(decode) == [("slow", 0), ("slow2", 0)]
    clock.now += 4.9
    assert not decode.has_unfinished_requests()
    clock.now += 0.2
    assert decode.has_unfinished_requests()
    outs = decode.step()
    assert {(o.request_id, o.finish_reason) for o in outs} == {
        ("slow", "kv_timeout"),
        ("slow2", "kv_timeout"),
        ("queued", "kv_timeout"),
    }
    assert decode.kv_cache.pool.num_free_blocks == 10 and not decode.requests
    assert (
        transfer.sender.status(handle.request_id) == TransferStatus.COMPLETED
    )  # the source was told to unpin
    assert prefill.num_pinned_blocks == 0
    decode.check_integrity()


def test_reserved_request_hits_its_own_prefix_cache_and_pulls_only_the_rest(pair):
    prefill, decode, transfer, _ = pair
    _handoff(prefill, decode, "first", start=7)
    _reserved(decode)
    transfer.receiver.arrived.add("first")
    first = _run(decode)["first"]
    handle = _handoff(
        prefill, decode, "again", start=7
    )  # same 60-token prompt: 3 full blocks cached here
    assert _reserved(decode) == [("again", 3)]
    pulled = transfer.receiver.bytes_transferred
    transfer.receiver.arrived.add("again")
    assert _run(decode)["again"] == first
    assert (
        transfer.receiver.bytes_transferred - pulled
        == (len(handle.block_ids) - 3) * decode.kv_cache.spec.bytes_per_block
    )


def _reserved(engine, **kwargs) -> list[tuple[str, int]]:
    return [(r.request_id, r.first_block) for r in engine.take_reserved(**kwargs)]


def test_a_caller_writes_claimed_kv_and_an_ended_request_waits_for_it(pair, tiny_llama):
    """With claimed writes the caller copies the pulled KV into the reserved blocks itself; the
    engine then runs the request without pulling, and never frees blocks a caller still writes."""
    prefill, decode, transfer, clock = pair
    handle = _handoff(prefill, decode, "w")
    (reserved,) = decode.take_reserved(claim_writes=True)
    assert reserved.block_ids == tuple(decode.reservations.reserved[0].block_table[:4])
    transfer.receiver.arrived.add(
        "w"
    )  # the transfer could serve it, but the caller claimed the writes
    assert not decode.has_unfinished_requests()
    for piece in transfer.receiver.pull(handle):
        decode.kv_cache.write_blocks(list(reserved.block_ids), piece)
    pulled = transfer.receiver.bytes_transferred
    decode.kv_written("w", ok=True)
    assert _run(decode)["w"] == _both(tiny_llama, "w")
    assert transfer.receiver.bytes_transferred == pulled  # the engine did not pull again

    _handoff(prefill, decode, "gone")
    decode.take_reserved(claim_writes=True)
    decode.abort("gone")  # e.g. the client left while the caller writes
    assert decode.kv_cache.pool.num_free_blocks == 10 - 4 and not decode.requests
    decode.check_integrity()
    decode.kv_written("gone", ok=False)
    assert decode.kv_cache.pool.num_free_blocks == 10
    decode.check_integrity()


def _both(model: str, rid: str) -> list[int]:
    from tests.engine.helpers import run_to_completion

    start = 3 + 100 * (sum(map(ord, rid)) % 4)
    both = make_engine(model, num_blocks=64)
    out, _ = run_to_completion(
        both, {rid: (list(range(start, start + 60)), SamplingParams(max_tokens=6, **GREEDY))}
    )
    return out[rid]


def _run(engine) -> dict[str, list[int]]:
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.output_token_ids
        engine.check_integrity()
    return done
