"""The flow's worker calls (services/router/pool/worker_calls.py): the Prefill and Decode
messages built from a WorkerRequest, and the replies read back as dataclasses, without a
worker (stand-in stubs and calls)."""

from __future__ import annotations

import grpc
import pytest

from services.common.pb import common_pb2, worker_pb2
from services.engine.outputs import TokenLogprobs
from services.engine.sampling_params import SamplingParams
from services.kv_transfer.handle import KVHandle
from services.router.pool.worker_calls import (
    DecodeReply,
    PrefillReply,
    RemoteKV,
    WorkerRequest,
    start_decode,
    start_prefill,
)

REQUEST = WorkerRequest("r-1", [5, 6, 7], SamplingParams(max_tokens=4, seed=3), "salt", [8])
HANDLE = KVHandle("r-1", "engine-a", (0, 1), 3, 8)
LOGPROB = common_pb2.TokenLogprob(
    token_id=8, logprob=-0.5, rank=1, top=[common_pb2.TopLogprob(token_id=8, logprob=-0.5)]
)


class _Recorder:
    """Stands in for a stub method: records the message, returns what it was given."""

    def __init__(self, answer) -> None:
        self.answer, self.sent = answer, []

    def __call__(self, message, timeout, metadata):
        self.sent.append((message, timeout))
        return self.answer

    future = __call__


class _Pool:
    def __init__(self, answer) -> None:
        self.method = _Recorder(answer)

    def prefill_stub(self, address):
        return type("Stub", (), {"Prefill": self.method})()

    def decode_stub(self, address):
        return type("Stub", (), {"Decode": self.method})()


class _Future:
    def __init__(self, reply) -> None:
        self.reply, self.cancelled = reply, False

    def result(self):
        return self.reply

    def cancel(self):
        self.cancelled = True
        return True


class _Call:
    """A response stream: its messages, then optionally an error."""

    def __init__(self, replies, error: grpc.RpcError | None = None) -> None:
        self._replies, self.error, self.cancelled = iter(replies), error, False

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self._replies)
        except StopIteration:
            if self.error is not None:
                raise self.error from None
            raise

    def cancel(self):
        self.cancelled = True
        return True


def _sent_fields(message) -> tuple:
    return (
        message.request_id,
        list(message.prompt_token_ids),
        message.sampling.max_tokens,
        message.sampling.seed,
        message.cache_salt,
        list(message.output_token_ids),
    )


def test_prefill_sends_the_request_and_reads_the_reply():
    reply = worker_pb2.PrefillResponse(
        first_token_id=8,
        kv_handle=common_pb2.KVHandle(
            request_id="r-1",
            engine_id="engine-a",
            block_ids=[0, 1],
            num_tokens=3,
            first_token_id=8,
            source="10.0.0.2:7000",
        ),  # fmt: skip
        first_logprob=LOGPROB,
        num_cached_tokens=2,
        compute_seconds=0.125,
    )
    future = _Future(reply)
    pool = _Pool(future)
    call = start_prefill(pool, "10.0.0.2:50051", REQUEST, timeout=3.0)
    ((message, timeout),) = pool.method.sent
    assert _sent_fields(message) == ("r-1", [5, 6, 7], 4, 3, "salt", [8]) and timeout == 3.0
    assert call.result() == PrefillReply(
        8,
        "",
        RemoteKV(HANDLE, "10.0.0.2:7000"),
        TokenLogprobs(8, -0.5, 1, ((8, -0.5),)),
        2,
        0.125,
    )
    assert call.cancel() and future.cancelled


def test_a_prefill_that_finished_has_no_kv_and_no_logprob():
    call = start_prefill(
        _Pool(_Future(worker_pb2.PrefillResponse(first_token_id=2, finish_reason="stop"))),
        "w:1",
        REQUEST,
        timeout=1.0,
    )
    reply = call.result()
    assert (reply.finish_reason, reply.kv, reply.first_logprob) == ("stop", None, None)


def test_decode_sends_the_handle_and_streams_replies():
    replies = [
        worker_pb2.DecodeResponse(
            token_ids=[9], kv_transfer_seconds=0.25, num_cached_tokens=1, compute_seconds=0.01
        ),
        worker_pb2.DecodeResponse(token_ids=[10, 11], finish_reason="length", logprobs=[LOGPROB]),
    ]
    pool = _Pool(_Call(replies))
    stream = start_decode(pool, "w:2", REQUEST, RemoteKV(HANDLE, "10.0.0.2:7000"), timeout=5.0)
    ((message, _),) = pool.method.sent
    assert _sent_fields(message) == ("r-1", [5, 6, 7], 4, 3, "salt", [8])
    assert (message.kv_handle.engine_id, list(message.kv_handle.block_ids)) == ("engine-a", [0, 1])
    assert message.kv_handle.source == "10.0.0.2:7000"
    assert list(stream) == [
        DecodeReply((9,), "", (), 0.25, 1, 0.01),
        DecodeReply((10, 11), "length", (TokenLogprobs(8, -0.5, 1, ((8, -0.5),)),), 0.0, 0, 0.0),
    ]


def test_local_decode_sends_no_handle():
    pool = _Pool(_Call([]))
    start_decode(pool, "w:2", REQUEST, None, timeout=5.0)
    assert not pool.method.sent[0][0].HasField("kv_handle")


@pytest.mark.parametrize(
    "replies, error, cancelled",
    [
        ([], None, False),  # the OK status: nothing to do
        ([worker_pb2.DecodeResponse(token_ids=[1])], None, True),  # a worker bug: cancelled
        ([], grpc.RpcError(), False),  # an error after finish_reason: logged, not raised
    ],
)
def test_drain_reads_a_finished_stream_to_its_end(replies, error, cancelled):
    raw = _Call(replies, error)
    stream = start_decode(_Pool(raw), "w:2", REQUEST, None, timeout=5.0)
    stream.drain()
    assert raw.cancelled == cancelled
