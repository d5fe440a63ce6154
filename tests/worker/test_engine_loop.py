"""EngineLoop: RPC threads reach a busy engine promptly, outputs stream, aborts free blocks."""

from __future__ import annotations

import os
import time

import pytest

from services.engine import SamplingParams
from services.worker.engine_loop import EngineLoop
from tests.engine.helpers import GREEDY, make_engine


def test_calls_are_served_while_the_engine_is_busy(tiny_llama):
    engine = make_engine(tiny_llama, num_blocks=512, max_model_len=1024)
    loop = EngineLoop(engine, "both")
    loop.start()
    try:
        stream = loop.submit("long", list(range(2, 50)), SamplingParams(max_tokens=900, **GREEDY))
        first = stream.get(timeout=30)
        assert first.request_id == "long" and not first.finished
        started = time.monotonic()
        for _ in range(20):  # each call waits for at most one step, never for the whole request
            assert loop.call(lambda: engine.scheduler.num_running) == 1
        assert time.monotonic() - started < 5
        assert loop.abort("long") is True
        assert loop.call(lambda: engine.kv_cache.pool.num_free_blocks) == 512
        assert loop.abort("long") is False
        done = loop.submit("short", [3, 4, 5], SamplingParams(max_tokens=3, **GREEDY))
        outputs = [done.get(timeout=30) for _ in range(3)]
        assert outputs[-1].finished and len(outputs[-1].output_token_ids) == 3
    finally:
        loop.stop()


def test_a_caller_that_left_before_the_add_leaves_nothing_to_prefill(tiny_llama):
    """The RPC's caller cancelled while its submit waited for a step: nothing is added, nothing
    is counted, and `abort_soon` returns at once while the loop frees a running request."""
    from services.common import metrics

    engine = make_engine(tiny_llama, num_blocks=64)
    loop = EngineLoop(engine, "both")
    loop.start()
    try:
        counted = metrics.PROMPT_TOKENS.labels("both")._value.get()
        stream = loop.submit(
            "gone", [3, 4, 5], SamplingParams(max_tokens=2, **GREEDY), caller_active=lambda: False
        )
        assert stream.empty()
        assert loop.call(lambda: "gone" not in engine.requests and engine.num_waiting == 0)
        assert metrics.PROMPT_TOKENS.labels("both")._value.get() == counted
        kept = loop.submit(
            "kept", [3, 4, 5], SamplingParams(max_tokens=500, **GREEDY), caller_active=lambda: True
        )
        assert kept.get(timeout=30).request_id == "kept"
        assert metrics.PROMPT_TOKENS.labels("both")._value.get() == counted + 3
        loop.abort_soon("kept")
        assert loop.call(lambda: "kept" not in engine.requests)
        assert loop.call(lambda: engine.kv_cache.pool.num_free_blocks) == 64
    finally:
        loop.stop()


def test_call_propagates_exceptions(tiny_llama):
    loop = EngineLoop(make_engine(tiny_llama, num_blocks=16), "both")
    loop.start()
    try:
        with pytest.raises(ZeroDivisionError):
            loop.call(lambda: 1 / 0)
        assert loop.call(lambda: 42) == 42
    finally:
        loop.stop()


def test_a_taken_port_is_refused():
    from services.common.grpc_server import start_service

    first = start_service("router", [], "127.0.0.1", 0, 0)
    try:
        port = int(first.grpc_address.rsplit(":", 1)[1])
        with pytest.raises(OSError, match="^port: cannot bind"):
            start_service("router", [], "127.0.0.1", port, 0)
    finally:
        first.server.stop(0)


def test_calls_after_stop_fail_fast(tiny_llama):
    from services.common.errors import ShuttingDownError

    loop = EngineLoop(make_engine(tiny_llama, num_blocks=16), "both")
    loop.start()
    loop.stop()
    started = time.monotonic()
    with pytest.raises(ShuttingDownError):
        loop.abort("anything")
    assert time.monotonic() - started < 1


def test_reserved_blocks_come_back_however_the_receiver_leaves(tiny_llama):
    """A DECODE request's reservation goes to its RPC thread, which writes the KV and reports
    back; blocks return to free when it reports, when it leaves without taking the reservation,
    and when the request timed out while the receiver was still writing."""
    from services.engine import EngineRole
    from services.engine.outputs import KVReserved
    from services.kv_transfer.in_memory import InMemoryKVTransfer

    transfer = InMemoryKVTransfer()
    prefill = make_engine(tiny_llama, role=EngineRole.PREFILL, num_blocks=64, kv_transfer=transfer)
    decode = make_engine(
        tiny_llama,
        role=EngineRole.DECODE,
        num_blocks=16,
        kv_transfer=transfer,
        kv_transfer_timeout_s=1.0,
    )
    loop = EngineLoop(decode, "decode")
    loop.start()
    params = SamplingParams(max_tokens=3, **GREEDY)

    def handoff(rid: str):
        prefill.add_request(list(range(3, 40)), params, request_id=rid)
        (out,) = prefill.step()
        return loop.submit(rid, list(range(3, 40)), params, kv_handle=out.kv_handle), out.kv_handle

    def free() -> int:
        return loop.call(lambda: decode.kv_cache.pool.num_free_blocks)

    try:
        stream, handle = handoff("written")  # the normal path: write, report, run
        reserved = stream.get(timeout=10)
        assert isinstance(reserved, KVReserved) and free() == 13
        (piece,) = transfer.receiver.pull(handle)
        decode.kv_cache.write_blocks(list(reserved.block_ids), piece)
        loop.kv_written("written", ok=True)
        assert [stream.get(timeout=10).finished for _ in range(2)] == [False, True]
        loop.abort("written")
        stream, _ = handoff("left")  # the receiver leaves before it takes the reservation
        time.sleep(0.2)
        loop.abort("left")
        assert free() == 16
        stream, _ = handoff("slow")  # times out while its receiver still writes
        assert isinstance(stream.get(timeout=10), KVReserved)
        assert stream.get(timeout=10).finish_reason == "kv_timeout"
        assert free() == 13  # held: the receiver may still be writing into them
        loop.kv_written("slow", ok=False)
        loop.abort("slow")
        assert free() == 16
        loop.call(decode.check_integrity)
        assert prefill.num_pinned_blocks == 0
    finally:
        loop.stop()


def test_the_step_log_and_the_engine_threads(tiny_llama, tmp_path):
    """`--step-log`: one record per step with its rows, seconds and the engine thread's torch
    threads; `threads` is the engine thread's own count, the process default untouched."""
    import torch

    from services.cost_model import step_log

    engine = make_engine(tiny_llama, num_blocks=64)
    path = tmp_path / "steps.jsonl"
    default = torch.get_num_threads()
    cpu = max(os.sched_getaffinity(0))
    loop = EngineLoop(engine, "both", step_log=str(path), threads=1, cpus=[cpu])
    loop.start()
    try:
        stream = loop.submit("r", list(range(2, 22)), SamplingParams(max_tokens=4, **GREEDY))
        outputs = [stream.get(timeout=30) for _ in range(4)]
        assert outputs[-1].finished
        assert loop.call(engine.num_threads) == 1 and torch.get_num_threads() == default
        assert loop.call(lambda: os.sched_getaffinity(0)) == {cpu}  # the engine thread pinned
    finally:
        loop.stop()
    records = step_log.read(path)
    assert [r.rows for r in records] == [((20, 0),), ((1, 20),), ((1, 21),), ((1, 22),)]
    assert all(r.threads == 1 and r.seconds > 0 for r in records)
