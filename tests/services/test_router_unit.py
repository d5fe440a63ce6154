"""Router unit tests: stop strings, validation, worker picks, and the full Generate flow over real
gRPC on loopback against tiny fake Prefill / Decode / KVTransfer servicers (no model processes).

The fakes return canned token ids of real text (the default model's tokenizer), so the streamed
text, finish_reason, usage and the cancellation of the decode stream are checked exactly.
"""

from __future__ import annotations

import argparse
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import REGISTRY

from services.common.errors import ServiceUnavailableError
from services.common.pb import (
    common_pb2,
    generate_pb2,
    generate_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from services.common.server import start_service
from services.engine.errors import InvalidRequestError
from services.router.cancel import CancelScope
from services.router.generate import GenerateFlow
from services.router.prompt import ModelInfo, prepare_request
from services.router.routing import Routing
from services.router.server import start_router
from services.router.stop import StopStringMatcher, first_stop_match
from services.router.workers import WorkerPool

PROMPT = "Hello world"
COMPLETION = " The answer is 42. STOP here, and then more text follows."
KV_TRANSFER_SECONDS = 0.25
CANCEL_WAIT_S = 10.0


# ---------------------------------------------------------------- stop strings


def _run_matcher(deltas: list[str], stop: list[str]) -> tuple[str, bool]:
    matcher, out, stopped = StopStringMatcher(stop), [], False
    for delta in deltas:
        text, stopped = matcher.add(delta)
        out.append(text)
        if stopped:
            break
    if not stopped:
        out.append(matcher.flush())
    return "".join(out), stopped


def test_possible_stop_prefix_is_held_back_until_it_cannot_match():
    matcher = StopStringMatcher(["STOP"])
    assert matcher.add("abc S") == ("abc ", False)  # "S" might start "STOP": held back
    assert matcher.held_back == "S"
    assert matcher.add("T") == ("", False)
    assert matcher.add("Ox") == ("STOx", False)  # cannot be "STOP" any more: released
    assert matcher.held_back == ""


def test_stop_string_across_three_deltas_stops_and_drops_the_rest():
    matcher = StopStringMatcher(["STOP"])
    assert matcher.add("say S") == ("say ", False)
    assert matcher.add("T") == ("", False)
    assert matcher.add("OP and more") == ("", True)
    assert matcher.add("anything") == ("", True)
    assert matcher.flush() == ""


def test_held_back_text_is_released_by_flush():
    matcher = StopStringMatcher(["</end>"])
    assert matcher.add("value </e") == ("value ", False)
    assert matcher.flush() == "</e"


def test_false_start_is_released_as_soon_as_it_cannot_match():
    matcher = StopStringMatcher(["STOP"])
    assert matcher.add("ST") == ("", False)
    assert matcher.add("ART") == ("START", False)


def test_multiple_stop_strings_first_to_complete_wins():
    assert _run_matcher(["xabcd"], ["abcd", "bc"]) == ("xa", True)
    assert _run_matcher(["xab", "cd"], ["abcd", "bc"]) == ("xa", True)
    assert _run_matcher(["one\n\ntwo"], ["two", "\n\n"]) == ("one", True)
    assert _run_matcher(["no match here"], ["zz", "qq"]) == ("no match here", False)


def test_empty_stop_string_is_refused():
    with pytest.raises(ValueError, match="stop"):
        StopStringMatcher(["ok", ""])


def _reference(text: str, stop: list[str]) -> tuple[str, bool]:
    start = first_stop_match(text, stop)
    return (text, False) if start is None else (text[:start], True)


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abST \n", max_size=40),
    stop=st.lists(st.text(alphabet="abST \n", min_size=1, max_size=5), max_size=3),
    cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=10),
)
def test_property_any_split_gives_the_unsplit_result_and_only_appends(text, stop, cuts):
    bounds = [0, *sorted(c for c in cuts if c <= len(text)), len(text)]
    deltas = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    matcher, emitted = StopStringMatcher(stop), ""
    for delta in deltas:
        out, stopped = matcher.add(delta)
        emitted += out
        assert text.startswith(emitted)  # only appends, never ahead of the input
        if stopped:
            break
    emitted += matcher.flush()
    assert (emitted, matcher.stopped) == _reference(text, stop)
    assert not any(s in emitted for s in stop)


# ---------------------------------------------------------------- validation


@pytest.fixture(scope="module")
def model_info() -> ModelInfo:
    return ModelInfo.load("smollm2-135m-instruct")


def _request(**sampling) -> generate_pb2.GenerateRequest:
    stop = sampling.pop("stop", [])
    return generate_pb2.GenerateRequest(
        text=PROMPT, sampling=common_pb2.SamplingParams(stop=stop, **sampling)
    )


@pytest.mark.parametrize(
    "sampling, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [10**6]}, "stop_token_ids"),
    ],
)
def test_bad_sampling_names_the_field(model_info, sampling, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        prepare_request(_request(**sampling), model_info)


def test_bad_prompts_name_the_field(model_info):
    cases = [
        (generate_pb2.GenerateRequest(), "prompt"),
        (generate_pb2.GenerateRequest(text=""), "prompt"),
        (generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=[])), "prompt"),
        (
            generate_pb2.GenerateRequest(
                token_ids=generate_pb2.TokenIds(ids=[5, model_info.vocab_size])
            ),
            "prompt_token_ids",
        ),
        (
            generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=[-1])),
            "prompt_token_ids",
        ),
        (generate_pb2.GenerateRequest(chat=generate_pb2.ChatMessages()), "prompt"),
        (
            generate_pb2.GenerateRequest(
                chat=generate_pb2.ChatMessages(messages=[{"role": "robot", "content": "x"}])
            ),
            r"chat\.messages\[0\]\.role",
        ),
    ]
    for request, field in cases:
        with pytest.raises(InvalidRequestError, match=f"^{field}:"):
            prepare_request(request, model_info)


def test_prompt_at_max_model_len_is_refused(model_info):
    short = ModelInfo.load(str(model_info.path), max_model_len=4)
    ids = generate_pb2.TokenIds(ids=[1, 2, 3, 4])
    with pytest.raises(InvalidRequestError, match="^prompt:.*max_model_len 4"):
        prepare_request(generate_pb2.GenerateRequest(token_ids=ids), short)
    assert prepare_request(
        generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=[1, 2, 3])), short
    )


def test_text_and_chat_tokenize_like_the_tokenizer(model_info):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_info.path)
    prepared = prepare_request(_request(max_tokens=3), model_info)
    assert prepared.prompt_token_ids == tok.encode(PROMPT, add_special_tokens=False)
    assert prepared.params.max_tokens == 3 and prepared.request_id
    messages = [{"role": "user", "content": "hi"}]
    chat = generate_pb2.GenerateRequest(chat=generate_pb2.ChatMessages(messages=messages))
    expected = tok.encode(
        tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    )
    assert prepare_request(chat, model_info).prompt_token_ids == expected


# ---------------------------------------------------------------- worker pool


def test_round_robin_picks_skip_unhealthy_workers_and_empty_pools():
    pool = WorkerPool(["127.0.0.1:1", "127.0.0.1:2"], ["127.0.0.1:3"])
    routing = Routing(pool, "round_robin")
    picks = [routing.pick_prefill([5, 6])[0] for _ in range(5)]
    assert picks == ["127.0.0.1:1", "127.0.0.1:2"] * 2 + ["127.0.0.1:1"]
    assert [routing.pick_decode() for _ in range(2)] == ["127.0.0.1:3"] * 2
    pool.unhealthy.add("127.0.0.1:2")
    assert {routing.pick_prefill([5])[0] for _ in range(3)} == {"127.0.0.1:1"}
    pool.unhealthy.add("127.0.0.1:1")  # all out: fail open, the calls themselves will say why
    assert {routing.pick_prefill([5])[0] for _ in range(4)} == {"127.0.0.1:1", "127.0.0.1:2"}
    assert pool.channel("127.0.0.1:1") is pool.channel("127.0.0.1:1")
    pool.close()
    empty = Routing(WorkerPool([], []), "round_robin")
    with pytest.raises(ServiceUnavailableError):
        empty.pick_prefill([5])
    with pytest.raises(ServiceUnavailableError):
        empty.pick_decode()
    with pytest.raises(ValueError, match="^decode:"):
        WorkerPool(["127.0.0.1:1"], ["nohost"])
    with pytest.raises(ValueError, match="^routing:"):
        Routing(WorkerPool([], []), "random")


def test_least_loaded_counts_queued_prompt_tokens_and_decode_streams():
    pool = WorkerPool(["127.0.0.1:1", "127.0.0.1:2"], ["127.0.0.1:3", "127.0.0.1:4"])
    routing = Routing(pool, "least_loaded")
    first, _ = routing.pick_prefill(list(range(100)))
    second, _ = routing.pick_prefill(list(range(10)))
    third, _ = routing.pick_prefill(list(range(10)))
    assert second != first and third == second  # 10 + 10 queued there is still less than 100
    routing.prefill_done(first, 100)
    assert routing.pick_prefill([1])[0] == first
    a, b = routing.pick_decode(), routing.pick_decode()
    assert {a, b} == {"127.0.0.1:3", "127.0.0.1:4"}
    routing.decode_done(a)
    assert routing.pick_decode() == a
    pool.close()


def test_flow_without_workers_is_unavailable(model_info):
    flow = GenerateFlow(model_info, WorkerPool([], []), request_timeout=5)
    with pytest.raises(ServiceUnavailableError):
        list(flow.generate(_request(), flow.deadline_for(None)))


# ---------------------------------------------------------------- fake workers


def _fake_logprob(token_id: int, request) -> common_pb2.TokenLogprob:
    """A made-up but checkable log-probability (for requests that ask for them)."""
    top = [
        common_pb2.TopLogprob(token_id=token_id + k, logprob=-0.5 - k)
        for k in range(request.sampling.logprobs)
    ]
    return common_pb2.TokenLogprob(token_id=token_id, logprob=-0.5, rank=1, top=top)


class FakePrefill(
    worker_pb2_grpc.PrefillServicer,
    worker_pb2_grpc.KVTransferServicer,
    worker_pb2_grpc.AdminServicer,
):
    """Returns a canned first token (and `cached_tokens`); records requests and ReleaseKV calls;
    answers ResetPrefixCache with 7 blocks cleared."""

    def __init__(self) -> None:
        self.source = ""
        self.reset([0])

    def reset(
        self, first_token: list[int], finish_reason: str = "", error: grpc.StatusCode | None = None
    ) -> None:
        self.first_token, self.finish_reason, self.error = first_token[0], finish_reason, error
        self.cached_tokens = 0
        self.requests: list[worker_pb2.PrefillRequest] = []
        self.released: list[str] = []

    def Prefill(self, request, context):  # noqa: N802
        self.requests.append(request)
        if self.error is not None:
            context.abort(self.error, "fake prefill refuses")
        handle = None
        if not self.finish_reason:
            handle = common_pb2.KVHandle(
                request_id=request.request_id,
                engine_id="fake",
                block_ids=[0],
                num_tokens=len(request.prompt_token_ids),
                first_token_id=self.first_token,
                source=self.source,
            )
        response = worker_pb2.PrefillResponse(
            first_token_id=self.first_token,
            finish_reason=self.finish_reason,
            kv_handle=handle,
            num_cached_tokens=self.cached_tokens,
        )
        if request.sampling.HasField("logprobs"):
            response.first_logprob.CopyFrom(_fake_logprob(self.first_token, request))
        return response

    def ReleaseKV(self, request, context):  # noqa: N802
        self.released.append(request.request_id)
        return worker_pb2.ReleaseKVResponse(released=True)

    def ResetPrefixCache(self, request, context):  # noqa: N802
        return worker_pb2.ResetPrefixCacheResponse(num_workers=1, num_hashes_dropped=7)


class FakeDecode(worker_pb2_grpc.DecodeServicer):
    """Streams canned messages; `endless` keeps sending filler tokens until cancelled."""

    def __init__(self) -> None:
        self.reset([])

    def reset(
        self,
        messages: list[list[int]],
        finish_reason: str = "length",
        endless_token: int | None = None,
        error: grpc.StatusCode | None = None,
    ) -> None:
        self.messages, self.finish_reason = messages, finish_reason
        self.endless_token, self.error = endless_token, error
        self.requests: list[worker_pb2.DecodeRequest] = []
        self.cancelled = threading.Event()

    def Decode(self, request, context):  # noqa: N802
        self.requests.append(request)
        if self.error is not None:
            context.abort(self.error, "fake decode refuses")
        try:
            yield from self._replies(context)
        except GeneratorExit:
            self.cancelled.set()
            raise
        finally:
            if not context.is_active():
                self.cancelled.set()

    def _replies(self, context):
        request = self.requests[-1]
        for i, ids in enumerate(self.messages):
            last = i == len(self.messages) - 1 and self.endless_token is None
            yield worker_pb2.DecodeResponse(
                token_ids=ids,
                finish_reason=self.finish_reason if last else "",
                kv_transfer_seconds=KV_TRANSFER_SECONDS if i == 0 else 0.0,
                logprobs=[
                    _fake_logprob(t, request) for t in ids if request.sampling.HasField("logprobs")
                ],
            )
        give_up = time.monotonic() + CANCEL_WAIT_S
        while self.endless_token is not None and time.monotonic() < give_up:
            if not context.is_active():
                self.cancelled.set()
                return
            time.sleep(0.02)
            yield worker_pb2.DecodeResponse(token_ids=[self.endless_token])


@pytest.fixture(scope="module")
def tokenizer(model_info):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_info.path)


@pytest.fixture(scope="module")
def cluster(model_info):
    """(router, fake prefill, fake decode) on loopback; the router serves gRPC and HTTP."""
    prefill, decode = FakePrefill(), FakeDecode()
    prefill_service = start_service(
        "prefill",
        [
            (worker_pb2_grpc.add_PrefillServicer_to_server, prefill, "pdserve.v1.Prefill"),
            (worker_pb2_grpc.add_KVTransferServicer_to_server, prefill, "pdserve.v1.KVTransfer"),
            (worker_pb2_grpc.add_AdminServicer_to_server, prefill, "pdserve.v1.Admin"),
        ],
        "127.0.0.1",
        0,
        0,
    )
    prefill.source = prefill_service.grpc_address
    decode_service = start_service(
        "decode",
        [(worker_pb2_grpc.add_DecodeServicer_to_server, decode, "pdserve.v1.Decode")],
        "127.0.0.1",
        0,
        0,
    )
    args = argparse.Namespace(
        model=str(model_info.path),
        host="127.0.0.1",
        port=0,
        metrics_port=0,
        prefill=[prefill_service.grpc_address],
        decode=[decode_service.grpc_address],
        request_timeout=30.0,
        http_port=0,
    )
    router = start_router(args)
    yield router, prefill, decode
    router.stop(0)
    prefill_service.server.stop(0).wait()
    decode_service.server.stop(0).wait()


@pytest.fixture
def stub(cluster):
    channel = grpc.insecure_channel(cluster[0].service.grpc_address)
    yield generate_pb2_grpc.GenerationStub(channel)
    channel.close()


def _script(cluster, ids: list[int], chunk: int = 2, **decode_kwargs) -> None:
    """Prefill returns ids[0]; decode streams the rest `chunk` tokens per message."""
    _, prefill, decode = cluster
    prefill.reset(ids[:1])
    decode.reset([ids[i : i + chunk] for i in range(1, len(ids), chunk)], **decode_kwargs)


def _metric(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, {"role": "router", **labels}) or 0.0


def _completion_ids(tokenizer, text: str = COMPLETION) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


# ---------------------------------------------------------------- gRPC flow


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
    assert 0 < last.timings.ttft <= last.timings.e2e and last.timings.prefill > 0
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
    flow = GenerateFlow(model_info, router.flow.pool, request_timeout=0.5)
    no_deadline = 9.2e18  # what grpc's time_remaining() reports for a call without a deadline
    assert flow.deadline_for(no_deadline) - time.monotonic() == pytest.approx(0.5, abs=0.1)
    assert flow.deadline_for(3.0) - time.monotonic() == pytest.approx(3.0, abs=0.1)
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        list(flow.generate(_request(max_tokens=500), flow.deadline_for(no_deadline)))
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
    ids = _completion_ids(tokenizer)
    _script(cluster, ids, error=grpc.StatusCode.UNAVAILABLE)
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(_request(), timeout=30))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert _wait_until(lambda: cluster[1].released == [cluster[1].requests[0].request_id])


def test_cancel_before_decode_releases_the_prefill_kv(cluster, model_info, tokenizer):
    """The client goes away between the Prefill response and the Decode call."""
    ids = _completion_ids(tokenizer)
    _script(cluster, ids)
    router, prefill, decode = cluster
    scope = CancelScope()
    responses = router.flow.generate(_request(), router.flow.deadline_for(None), scope)
    assert list(next(responses).token_ids) == ids[:1]
    scope.cancel()
    with pytest.raises(grpc.RpcError) as info:
        next(responses)
    assert info.value.code() == grpc.StatusCode.CANCELLED
    assert (
        _wait_until(lambda: prefill.released == [prefill.requests[0].request_id])
        and decode.requests == []
    )


# ---------------------------------------------------------------- HTTP API


def _post(url: str, body: dict) -> tuple[int, bytes]:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_http_completion(cluster, tokenizer):
    ids = _completion_ids(tokenizer)
    _script(cluster, ids)
    status, data = _post(
        cluster[0].http.url + "/v1/completions", {"prompt": PROMPT, "max_tokens": len(ids)}
    )
    body = json.loads(data)
    assert status == 200 and body["object"] == "text_completion"
    assert body["choices"][0]["text"] == tokenizer.decode(ids)
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == len(ids)


def test_http_completion_stream(cluster, tokenizer):
    ids = _completion_ids(tokenizer)
    _script(cluster, ids)
    payload = {
        "prompt": PROMPT,
        "stream": True,
        "stop": "STOP",
        "stream_options": {"include_usage": True},
    }
    status, data = _post(cluster[0].http.url + "/v1/completions", payload)
    events = [line[len("data: ") :] for line in data.decode().split("\n\n") if line]
    assert status == 200 and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == " The answer is 42. "
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] > 0


@pytest.mark.parametrize("stream", [True, False])
def test_http_client_disconnect_cancels_the_decode_stream(cluster, tokenizer, stream):
    ids = _completion_ids(tokenizer)
    _script(cluster, ids, endless_token=ids[1])
    http = cluster[0].http
    body = json.dumps({"prompt": PROMPT, "max_tokens": 5000, "stream": stream}).encode()
    sock = socket.create_connection((http.host, http.port), timeout=30)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    if stream:
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")  # headers, then events follow
    assert _wait_until(lambda: cluster[2].requests)  # the decode stream is running
    sock.close()
    assert cluster[2].cancelled.wait(CANCEL_WAIT_S), "the router did not cancel the decode stream"


def _wait_until(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return bool(predicate())


def test_http_completion_logprobs(cluster, tokenizer):
    ids = _completion_ids(tokenizer)
    _script(cluster, ids)
    status, data = _post(
        cluster[0].http.url + "/v1/completions",
        {"prompt": PROMPT, "max_tokens": len(ids), "logprobs": 2},
    )
    logprobs = json.loads(data)["choices"][0]["logprobs"]
    assert status == 200 and cluster[1].requests[0].sampling.logprobs == 2
    assert logprobs["tokens"] == [tokenizer.decode([t]) for t in ids]
    assert logprobs["token_logprobs"] == [-0.5] * len(ids)
    assert logprobs["top_logprobs"][0] == {
        tokenizer.decode([ids[0]]): -0.5,
        tokenizer.decode([ids[0] + 1]): -1.5,
    }
    assert logprobs["text_offset"][1] == len(logprobs["tokens"][0])


@pytest.mark.parametrize("stream", [False, True])
def test_http_chat_logprobs(cluster, tokenizer, stream):
    ids = _completion_ids(tokenizer)
    _script(cluster, ids)
    payload = {
        "messages": [{"role": "user", "content": "hi"}],
        "logprobs": True,
        "top_logprobs": 1,
        "stream": stream,
    }
    status, data = _post(cluster[0].http.url + "/v1/chat/completions", payload)
    assert status == 200
    if stream:
        chunks = [
            json.loads(line[len("data: ") :])
            for line in data.decode().split("\n\n")
            if line and "[DONE]" not in line
        ]
        content = [
            entry
            for c in chunks
            if c["choices"][0]["logprobs"]
            for entry in c["choices"][0]["logprobs"]["content"]
        ]
    else:
        content = json.loads(data)["choices"][0]["logprobs"]["content"]
    assert [entry["token"] for entry in content] == [tokenizer.decode([t]) for t in ids]
    assert all(entry["logprob"] == -0.5 and len(entry["top_logprobs"]) == 1 for entry in content)
    assert content[0]["bytes"] == list(content[0]["token"].encode())


def test_http_chat_completion_uses_the_chat_template(cluster, model_info, tokenizer):
    ids = _completion_ids(tokenizer)
    _script(cluster, ids)
    messages = [{"role": "user", "content": "hi"}]
    status, data = _post(cluster[0].http.url + "/v1/chat/completions", {"messages": messages})
    body = json.loads(data)
    assert status == 200 and body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": tokenizer.decode(ids)}
    expected = tokenizer.encode(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    )
    assert list(cluster[1].requests[0].prompt_token_ids) == expected


@pytest.mark.parametrize(
    "path, payload, field",
    [
        ("/v1/completions", {"prompt": PROMPT, "temperature": -1}, "temperature"),
        ("/v1/completions", {"prompt": PROMPT, "stream": True, "top_p": 2}, "top_p"),
        ("/v1/completions", {"max_tokens": 4}, "prompt"),
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": "many"}, "max_tokens"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
            "top_logprobs",
        ),
        ("/v1/completions", {"prompt": PROMPT, "logprobs": 21}, "logprobs"),
        ("/v1/completions", {"prompt": PROMPT, "echo": True}, "echo"),
        ("/v1/completions", {"prompt": PROMPT, "n": 2}, "n"),
        ("/v1/completions", {"prompt": PROMPT, "cache_salt": 5}, "cache_salt"),
        ("/v1/completions", {"prompt": PROMPT, "cache_salt": ""}, "cache_salt"),
        ("/v1/completions", {"prompt": PROMPT, "cache_salt": "s" * 1025}, "cache_salt"),
    ],
)
def test_http_bad_input_is_400_naming_the_field(cluster, path, payload, field):
    status, data = _post(cluster[0].http.url + path, payload)
    error = json.loads(data)["error"]
    assert status == 400 and error["type"] == "invalid_request_error"
    assert error["message"].startswith(f"{field}:") and error["param"] == field


def test_http_overload_is_429(cluster):
    cluster[1].reset([1], error=grpc.StatusCode.RESOURCE_EXHAUSTED)
    status, data = _post(cluster[0].http.url + "/v1/completions", {"prompt": PROMPT})
    assert status == 429 and json.loads(data)["error"]["message"]


def test_http_health_and_models(cluster, model_info):
    url = cluster[0].http.url
    with urllib.request.urlopen(url + "/health", timeout=10) as reply:
        assert reply.status == 200
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as reply:
        model = json.loads(reply.read())["data"][0]
    assert (
        model["id"] == str(model_info.path) and model["max_model_len"] == model_info.max_model_len
    )
    assert json.loads(cluster[0].ready_line()[len("ready ") :])["http"] == url


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


def test_cache_salt_reaches_both_workers_and_cached_tokens_reach_usage(cluster, tokenizer):
    ids = _completion_ids(tokenizer)
    _script(cluster, ids)
    cluster[1].cached_tokens = 32
    status, data = _post(
        cluster[0].http.url + "/v1/completions",
        {"prompt": PROMPT, "max_tokens": len(ids), "cache_salt": "tenant-a"},
    )
    assert status == 200
    assert json.loads(data)["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
    assert cluster[1].requests[-1].cache_salt == cluster[2].requests[-1].cache_salt == "tenant-a"


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


def test_health_checks_take_a_worker_out_and_bring_it_back():
    """A worker whose health service says NOT_SERVING (or that stops answering) for 2 checks
    gets no new requests; once it answers SERVING again it is back."""
    from grpc_health.v1 import health_pb2

    service = start_service("prefill", [], "127.0.0.1", 0, 0)
    other = start_service("prefill", [], "127.0.0.1", 0, 0)
    pool = WorkerPool([service.grpc_address, other.grpc_address], [])
    routing = Routing(pool, "round_robin")
    try:
        pool.start_health_checks(interval_s=0.05, timeout_s=0.5)

        def picks() -> set[str]:
            return {routing.pick_prefill([1])[0] for _ in range(4)}

        assert picks() == {service.grpc_address, other.grpc_address}
        service.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        deadline = time.monotonic() + 5
        while picks() != {other.grpc_address}:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        service.health.set("", health_pb2.HealthCheckResponse.SERVING)
        while picks() != {service.grpc_address, other.grpc_address}:
            assert time.monotonic() < deadline + 5
            time.sleep(0.05)
        other.server.stop(0).wait()  # gone for good: taken out too
        while picks() != {service.grpc_address}:
            assert time.monotonic() < deadline + 10
            time.sleep(0.05)
    finally:
        pool.close()
        service.server.stop(0)
        other.server.stop(0)


def test_kv_routing_without_redis_learns_where_it_sent_each_prefix():
    """The approximate in-process index: after a prompt went to a worker, prompts sharing its
    full blocks go there too; other prompts spread by load; the guesses per worker are capped."""
    pool = WorkerPool(["127.0.0.1:1", "127.0.0.1:2"], ["127.0.0.1:3"])
    pool.prefill_layout = lambda: ("model@0", 16)
    pool.prefill_num_blocks = lambda: 4
    routing = Routing(pool, "kv")

    def route(prompt: list[int]) -> tuple[str, int]:
        address, expected = routing.pick_prefill(prompt)
        routing.prefill_done(address, len(prompt))
        routing.learn_routed(address, prompt)
        return address, expected

    shared = list(range(2, 50))  # 3 full blocks
    first, expected = route(shared + [7])
    assert expected == 0
    for suffix in ([8], [9, 10], [11] * 20):
        assert route(shared + suffix) == (first, 48)
    # New prompts, cached nowhere: equal cost, so consecutive ones alternate.
    assert route(list(range(100, 140)))[0] != route(list(range(300, 340)))[0]
    # 4 blocks at most per worker: a long new prompt on `first` pushes the shared prefix out.
    routing.learn_routed(first, list(range(200, 280)))
    assert route(shared + [12])[1] == 0
    pool.close()
