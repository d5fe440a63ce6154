"""Fakes and helpers the router tests share: tiny Prefill / Decode / KVTransfer / Admin
servicers that answer over real gRPC on loopback (no model processes), canned requests (a
Generate message for the gRPC API, a `GenerationRequest` for the flow itself), and small helpers
for metrics, HTTP posts and polling.

The fakes return canned token ids of real text (the default model's tokenizer), so the streamed
text, finish_reason, usage and the cancellation of the decode stream are checked exactly.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import grpc
from prometheus_client import REGISTRY

from services.common.pb import common_pb2, generate_pb2, worker_pb2, worker_pb2_grpc
from services.engine.sampling_params import SamplingParams
from services.router.flow.messages import GenerationRequest

PROMPT = "Hello world"
COMPLETION = " The answer is 42. STOP here, and then more text follows."
KV_TRANSFER_SECONDS = 0.25
COMPUTE_SECONDS = 1e-4  # what each fake worker reports for its first token's compute
CANCEL_WAIT_S = 10.0


def _request(**sampling) -> generate_pb2.GenerateRequest:
    stop = sampling.pop("stop", [])
    return generate_pb2.GenerateRequest(
        text=PROMPT, sampling=common_pb2.SamplingParams(stop=stop, **sampling)
    )


def _flow_request(**sampling) -> GenerationRequest:
    """What `_request` asks for, as the flow takes it."""
    stop = sampling.pop("stop", ())
    return GenerationRequest(text=PROMPT, sampling=SamplingParams(**sampling), stop=stop)


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
            compute_seconds=COMPUTE_SECONDS,
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
                compute_seconds=COMPUTE_SECONDS if i == 0 else 0.0,
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


def _script(cluster, ids: list[int], chunk: int = 2, **decode_kwargs) -> None:
    """Prefill returns ids[0]; decode streams the rest `chunk` tokens per message."""
    _, prefill, decode = cluster
    prefill.reset(ids[:1])
    decode.reset([ids[i : i + chunk] for i in range(1, len(ids), chunk)], **decode_kwargs)


def _metric(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, {"role": "router", **labels}) or 0.0


def _completion_ids(tokenizer, text: str = COMPLETION) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _post(url: str, body: dict, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _wait_until(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return bool(predicate())
