"""The Generate flow (services/router/flow/generate.py) over real gRPC through the fake prefill and
decode workers: streamed text, usage and timings, stop strings, cancels and deadlines, errors,
and the release of the prefill KV when the decode side never takes it."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from services.common.errors import ServiceUnavailableError
from services.common.pb import common_pb2, generate_pb2
from services.router.flow.cancel import CancelScope
from services.router.flow.generate import GenerateFlow
from services.router.pool.worker_pool import WorkerPool
from tests.router.fakes import (
    CANCEL_WAIT_S,
    COMPUTE_SECONDS,
    KV_TRANSFER_SECONDS,
    PROMPT,
    _completion_ids,
    _flow_request,
    _metric,
    _request,
    _script,
    _wait_until,
)


def test_flow_without_workers_is_unavailable(model_info):
    flow = GenerateFlow(model_info, WorkerPool([], []), request_timeout=5, disaggregation="always")
    with pytest.raises(ServiceUnavailableError):
        list(flow.generate(_flow_request(), flow.deadline_for(None)))


def test_generate_streams_text_usage_and_timings(cluster, stub, tokenizer):
    ids = _completion_ids(tokenizer)
    _script(cluster, ids)
    successes = _metric("pdserve_request_success_total", finish_reason="length")
    ttft_count = _metric("pdserve_time_to_first_token_seconds_count")
    tpot_count = _metric("pdserve_time_per_output_token_seconds_count")
    kv_sum = _metric("pdserve_kv_transfer_seconds_sum")
    responses = list(stub.Generate(_request(max_tokens=len(ids)), timeout=30))
    _, prefill, decode = cluster
    assert responses[0].token_ids == ids[:1]  # the first token streams on its own (TTFT)
    assert [t for r in responses for t in r.token_ids] == ids
    assert "".join(r.text for r in responses) == tokenizer.decode(ids)
    last = responses[-1]
    assert last.finish_reason == "length" and all(not r.finish_reason for r in responses[:-1])
    prompt_ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.cached_tokens) == (
        len(prompt_ids),
        len(ids),
        0,
    )
    assert last.timings.kv_transfer == pytest.approx(KV_TRANSFER_SECONDS)
    assert 0 < last.timings.ttft <= last.timings.e2e and last.timings.path == "remote"
    assert last.timings.prefill == last.timings.first_decode_step == COMPUTE_SECONDS
    assert list(prefill.requests[0].prompt_token_ids) == prompt_ids
    assert prefill.requests[0].sampling.max_tokens == len(ids)
    assert decode.requests[0].kv_handle.request_id == prefill.requests[0].request_id
    assert prefill.released == []  # the KV landed on the decode worker
    assert not decode.cancelled.is_set()  # a finished stream is read to its end, not cancelled
    assert _metric("pdserve_request_success_total", finish_reason="length") == successes + 1
    assert _metric("pdserve_time_to_first_token_seconds_count") == ttft_count + 1
    assert _metric("pdserve_time_per_output_token_seconds_count") == tpot_count + 1
    assert _metric("pdserve_kv_transfer_seconds_sum") == pytest.approx(kv_sum + KV_TRANSFER_SECONDS)


def test_concurrent_requests_share_the_tokenizer_safely(cluster, stub, tokenizer):
    ids = _completion_ids(tokenizer)
    _script(cluster, ids, chunk=1)
    prompts = [f"{PROMPT} number {i} " * (1 + i % 7) for i in range(24)]

    def run(prompt: str) -> tuple[str, int]:
        request = generate_pb2.GenerateRequest(
            text=prompt, sampling=common_pb2.SamplingParams(stop=["STOP"])
        )
        responses = list(stub.Generate(request, timeout=30))
        return "".join(r.text for r in responses), responses[-1].usage.prompt_tokens

    with ThreadPoolExecutor(max_workers=12) as pool:
        results = list(pool.map(run, prompts))
    for prompt, (text, prompt_tokens) in zip(prompts, results, strict=True):
        assert text == " The answer is 42. "
        assert prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))


def test_stop_string_spanning_tokens_cancels_the_decode_stream(cluster, stub, tokenizer):
    ids = _completion_ids(tokenizer)
    _script(cluster, ids, chunk=1, endless_token=_completion_ids(tokenizer, " more")[0])
    responses = list(stub.Generate(_request(stop=["42. ST"], max_tokens=500), timeout=30))
    text = "".join(r.text for r in responses)
    assert text == " The answer is "
    assert responses[-1].finish_reason == "stop"
    n_until_stop = next(n for n in range(1, len(ids) + 1) if "42. ST" in tokenizer.decode(ids[:n]))
    assert [t for r in responses for t in r.token_ids] == ids[:n_until_stop]
    assert responses[-1].usage.completion_tokens == n_until_stop
    assert cluster[2].cancelled.wait(CANCEL_WAIT_S), "the router did not cancel the decode stream"


def test_first_token_that_finishes_skips_decode(cluster, stub, tokenizer):
    ids = _completion_ids(tokenizer)
    _, prefill, decode = cluster
    prefill.reset(ids[:1], finish_reason="length")
    decode.reset([])
    responses = list(stub.Generate(_request(max_tokens=1), timeout=30))
    assert len(responses) == 1
    assert (list(responses[0].token_ids), responses[0].text, responses[0].finish_reason) == (
        ids[:1],
        tokenizer.decode(ids[:1]),
        "length",
    )
    assert responses[0].usage.completion_tokens == 1 and decode.requests == []


def test_stop_string_in_first_token_releases_the_prefill_kv(cluster, stub, tokenizer):
    ids = _completion_ids(tokenizer)
    _script(cluster, ids)
    responses = list(stub.Generate(_request(stop=["The"]), timeout=30))
    assert [(r.text, r.finish_reason) for r in responses] == [(" ", "stop")]
    _, prefill, decode = cluster
    assert _wait_until(
        lambda: prefill.released == [prefill.requests[0].request_id]
    )  # sent without waiting
    assert decode.requests == []


def test_client_cancel_cancels_the_decode_stream(cluster, stub, tokenizer):
    ids = _completion_ids(tokenizer)
    _script(cluster, ids, endless_token=ids[1])
    cancelled = _metric("pdserve_request_errors_total", code="CANCELLED")
    call = stub.Generate(_request(max_tokens=500), timeout=30)
    next(call), next(call)
    call.cancel()
    assert cluster[2].cancelled.wait(CANCEL_WAIT_S), "the router did not cancel the decode stream"
    deadline = time.monotonic() + 5
    while (
        _metric("pdserve_request_errors_total", code="CANCELLED") == cancelled
        and time.monotonic() < deadline
    ):
        time.sleep(0.02)
    assert _metric("pdserve_request_errors_total", code="CANCELLED") == cancelled + 1


def test_client_deadline_bounds_the_decode_stream(cluster, stub, tokenizer):
    ids = _completion_ids(tokenizer)
    _script(cluster, ids, endless_token=ids[1])
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(_request(max_tokens=500), timeout=0.5))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert cluster[2].cancelled.wait(CANCEL_WAIT_S)


def test_client_without_deadline_gets_the_request_timeout(cluster, model_info, tokenizer):
    ids = _completion_ids(tokenizer)
    _script(cluster, ids, endless_token=ids[1])
    router, _, decode = cluster
    flow = GenerateFlow(model_info, router.flow.pool, request_timeout=0.5, disaggregation="always")
    no_deadline = 9.2e18  # what grpc's time_remaining() reports for a call without a deadline
    assert flow.deadline_for(no_deadline) - time.monotonic() == pytest.approx(0.5, abs=0.1)
    assert flow.deadline_for(3.0) - time.monotonic() == pytest.approx(3.0, abs=0.1)
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        list(flow.generate(_flow_request(max_tokens=500), flow.deadline_for(no_deadline)))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() - start < 5
    assert decode.cancelled.wait(CANCEL_WAIT_S)


def test_invalid_request_is_invalid_argument_naming_the_field(cluster, stub):
    _script(cluster, [1, 2])
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(_request(temperature=-1.0), timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("temperature:")
    assert cluster[1].requests == []


def test_prefill_error_keeps_its_code(cluster, stub):
    _, prefill, _ = cluster
    prefill.reset([1], error=grpc.StatusCode.RESOURCE_EXHAUSTED)
    errors = _metric("pdserve_request_errors_total", code="RESOURCE_EXHAUSTED")
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(_request(), timeout=30))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert _metric("pdserve_request_errors_total", code="RESOURCE_EXHAUSTED") == errors + 1


def test_decode_failure_before_kv_landed_releases_the_prefill_kv(cluster, stub, tokenizer):
    """A decode worker that fails every call: the request migrates max_migrations times (each
    attempt prefilled under its own id), then ends UNAVAILABLE naming the worker; every
    attempt's prompt KV is released."""
    ids = _completion_ids(tokenizer)
    _script(cluster, ids, error=grpc.StatusCode.UNAVAILABLE)
    router, prefill, decode = cluster
    migrations = _metric("pdserve_request_migrations_total", reason="decode_failed")
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(_request(), timeout=30))
    max_migrations = router.flow.migration.max_migrations
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert router.flow.pool.decode[0] in info.value.details()
    assert f"after {max_migrations} migration(s)" in info.value.details()
    rids = [r.request_id for r in prefill.requests]
    assert len(rids) == len(set(rids)) == 1 + max_migrations
    # each attempt resumes after every token the client has (the fake prefill repeats its one)
    assert [list(r.output_token_ids) for r in prefill.requests] == [
        ids[:1] * n for n in range(1 + max_migrations)
    ]
    assert _wait_until(lambda: sorted(prefill.released) == sorted(rids))
    assert _metric("pdserve_request_migrations_total", reason="decode_failed") == (
        migrations + max_migrations
    )


def test_cancel_before_decode_releases_the_prefill_kv(cluster, model_info, tokenizer):
    """The client goes away between the Prefill response and the Decode call."""
    ids = _completion_ids(tokenizer)
    _script(cluster, ids)
    router, prefill, decode = cluster
    scope = CancelScope()
    responses = router.flow.generate(_flow_request(), router.flow.deadline_for(None), scope)
    assert list(next(responses).token_ids) == ids[:1]
    scope.cancel()
    with pytest.raises(grpc.RpcError) as info:
        next(responses)
    assert info.value.code() == grpc.StatusCode.CANCELLED
    assert (
        _wait_until(lambda: prefill.released == [prefill.requests[0].request_id])
        and decode.requests == []
    )
    # the decode worker it had picked is not left counting a stream that never started
    assert router.flow.routing.in_flight[router.flow.pool.decode[0]] == 0


def test_logprobs_follow_the_accepted_tokens(cluster, stub, tokenizer):
    """A stop string cuts the stream mid-message: logprobs are cut with the tokens."""
    ids = _completion_ids(tokenizer)
    _script(cluster, ids, chunk=3)
    sampling = common_pb2.SamplingParams(max_tokens=len(ids), stop=["42"], logprobs=1)
    messages = list(
        stub.Generate(generate_pb2.GenerateRequest(text=PROMPT, sampling=sampling), timeout=30)
    )
    tokens = [t for m in messages for t in m.token_ids]
    assert messages[-1].finish_reason == "stop" and len(tokens) < len(ids)
    assert [lp.token_id for m in messages for lp in m.logprobs] == tokens


def test_a_router_shutting_down_ends_streams_unavailable_not_cancelled(cluster, stub, tokenizer):
    """What the server ends is the server's doing: UNAVAILABLE (and counted so), never CANCELLED;
    new requests are refused while it stops."""
    ids = _completion_ids(tokenizer)
    _script(cluster, ids, chunk=1, endless_token=_completion_ids(tokenizer, " more")[0])
    router = cluster[0]
    unavailable = _metric("pdserve_request_errors_total", code="UNAVAILABLE")
    cancelled = _metric("pdserve_request_errors_total", code="CANCELLED")
    call = stub.Generate(_request(max_tokens=500), timeout=30)
    assert next(call).token_ids and next(call).token_ids  # the prefill's token, then decode's
    router.flow.stopping.set()
    try:
        assert router.flow.end_all() == 1
        with pytest.raises(grpc.RpcError) as info:
            list(call)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert info.value.details() == "the router is shutting down"
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(_request(), timeout=30))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        router.flow.stopping.clear()
    assert _metric("pdserve_request_errors_total", code="UNAVAILABLE") == unavailable + 2
    assert _metric("pdserve_request_errors_total", code="CANCELLED") == cancelled
    assert cluster[2].cancelled.wait(CANCEL_WAIT_S)  # the decode stream was cancelled downstream
