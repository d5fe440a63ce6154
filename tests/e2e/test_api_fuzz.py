"""Property-based tests (hypothesis) of the public APIs of a real cluster: 2,000 random and
malformed HTTP requests and 500 random gRPC requests. Each gets a well-formed answer or a 4xx /
INVALID_ARGUMENT; afterwards the cluster answers a normal request and no worker holds a leaked
or pinned KV block."""

from __future__ import annotations

import http.client
import json
import time

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.common.pb import common_pb2, generate_pb2
from tests.e2e.cluster import generation_stub, worker_info
from tests.e2e.conftest import KEY

pytestmark = pytest.mark.e2e

NUM_HTTP = 2000
NUM_GRPC = 500
HTTP_STATUSES = {200, 400, 401, 404, 405, 413}
SMALL_INTS = st.integers(-3, 4)
ODD_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False),
    st.text(max_size=8),
    st.lists(st.integers(-5, 60000), max_size=4),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)
# Fields that change the work a valid request does are kept small (max_tokens, n, prompts).
FIELD_VALUES = {
    "model": st.one_of(st.none(), st.just("gpt-4"), st.text(max_size=6)),
    "prompt": st.one_of(
        st.text(max_size=40),
        st.lists(st.integers(-2, 50000), max_size=6),
        st.lists(st.text(max_size=10), max_size=3),
        ODD_VALUES,
    ),
    "messages": st.one_of(
        st.lists(
            st.fixed_dictionaries(
                {
                    "role": st.sampled_from(["user", "system", "developer", "assistant", "x", 3]),
                    "content": st.one_of(
                        st.text(max_size=20),
                        st.lists(
                            st.fixed_dictionaries({"type": st.just("text"), "text": ODD_VALUES}),
                            max_size=2,
                        ),
                        ODD_VALUES,
                    ),
                }
            ),
            max_size=3,
        ),
        ODD_VALUES,
    ),
    "max_tokens": st.one_of(
        SMALL_INTS, st.just(10**9), ODD_VALUES.filter(lambda v: not isinstance(v, int) or v < 5)
    ),
    "max_completion_tokens": st.one_of(SMALL_INTS, st.text(max_size=3)),
    "n": st.one_of(st.integers(-1, 3), st.just(1000), st.text(max_size=2)),
    "temperature": st.one_of(st.floats(-1, 3), ODD_VALUES),
    "top_p": st.one_of(st.floats(-0.5, 1.5), ODD_VALUES),
    "top_k": st.one_of(SMALL_INTS, ODD_VALUES),
    "seed": st.one_of(st.integers(-5, 2**64 + 5), ODD_VALUES),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=3), ODD_VALUES),
    "stream": st.one_of(st.booleans(), ODD_VALUES),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": ODD_VALUES}), ODD_VALUES),
    "logprobs": st.one_of(st.integers(-1, 22), st.booleans(), ODD_VALUES),
    "top_logprobs": st.one_of(st.integers(-1, 22), ODD_VALUES),
    "echo": st.one_of(st.booleans(), ODD_VALUES),
    "presence_penalty": st.one_of(st.floats(-3, 3), ODD_VALUES),
    "frequency_penalty": st.one_of(st.floats(-3, 3), ODD_VALUES),
    "repetition_penalty": st.one_of(st.floats(-1, 3), ODD_VALUES),
    "logit_bias": st.one_of(
        st.dictionaries(
            st.one_of(st.integers(-5, 60000).map(str), st.text(max_size=3)),
            st.one_of(st.floats(-200, 200), ODD_VALUES),
            max_size=3,
        ),
        ODD_VALUES,
    ),
    "ignore_eos": st.one_of(st.booleans(), ODD_VALUES),
    "cache_salt": st.one_of(st.text(max_size=5), ODD_VALUES),
    "response_format": st.one_of(
        st.just({"type": "text"}), st.just({"type": "json_object"}), ODD_VALUES
    ),
    "tools": ODD_VALUES,
    "tool_choice": st.one_of(st.sampled_from(["none", "auto", "required"]), ODD_VALUES),
    "best_of": st.one_of(SMALL_INTS, ODD_VALUES),
    "suffix": ODD_VALUES,
    "unknown_field": ODD_VALUES,
}
BODIES = st.one_of(
    st.fixed_dictionaries({}, optional=FIELD_VALUES).map(lambda d: json.dumps(d).encode()),
    st.fixed_dictionaries({}, optional=FIELD_VALUES).map(lambda d: json.dumps(d).encode()[:-3]),
    st.binary(max_size=64),
    st.just(b'{"prompt": "a\\ud800", "max_tokens": 2}'),
    ODD_VALUES.map(lambda v: json.dumps(v).encode()),
)
REQUESTS = st.tuples(
    st.sampled_from(["POST"] * 8 + ["GET", "PUT", "DELETE"]),
    st.sampled_from(
        ["/v1/completions", "/v1/chat/completions"] * 4
        + ["/v1/models", "/v1/models/gpt-4", "/v1/completions/", "/nope", "/health"]
    ),
    BODIES,
    st.sampled_from([KEY] * 9 + ["", "wrong"]),
)


def _check_http(conn: http.client.HTTPConnection, method: str, path: str, body: bytes, key: str):
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    conn.request(method, path, body=body if method != "GET" else None, headers=headers)
    reply = conn.getresponse()
    data = reply.read()
    assert reply.status in HTTP_STATUSES, (reply.status, method, path, body, data[:300])
    if reply.headers.get("content-type", "").startswith("text/event-stream"):
        events = [e for e in data.decode().split("\n\n") if e]
        assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)
        for event in events[:-1]:
            json.loads(event[len("data: ") :])
        return
    decoded = json.loads(data)
    if reply.status >= 400:
        error = decoded["error"]
        assert error["message"] and error["code"] == reply.status and "type" in error


@pytest.fixture(scope="module")
def cluster(openai_cluster):
    return openai_cluster


def _http_connection(cluster) -> http.client.HTTPConnection:
    host, port = cluster.ready["http"].removeprefix("http://").split(":")
    return http.client.HTTPConnection(host, int(port), timeout=60)


def test_random_http_requests_get_well_formed_answers(cluster):
    conn = [_http_connection(cluster)]
    count = [0]

    @settings(
        max_examples=NUM_HTTP,
        deadline=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
        database=None,
    )
    @given(REQUESTS)
    def one(request):
        count[0] += 1
        try:
            _check_http(conn[0], *request)
        except (http.client.HTTPException, ConnectionError):  # the server closed after an error
            conn[0].close()
            conn[0] = _http_connection(cluster)
            _check_http(conn[0], *request)

    one()
    assert count[0] == NUM_HTTP
    _assert_clean(cluster)


TEXTS = st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=30)
SAMPLING = st.builds(
    common_pb2.SamplingParams,
    max_tokens=st.integers(-2, 4),
    temperature=st.floats(-1, 3, width=32),
    top_p=st.floats(-0.5, 1.5, width=32),
    top_k=st.integers(-3, 5),
    seed=st.integers(0, 2**64 - 1),
    stop=st.lists(st.text(max_size=3), max_size=2),
    stop_token_ids=st.lists(st.integers(-3, 60000), max_size=2),
    logprobs=st.integers(-1, 22),
    presence_penalty=st.floats(-3, 3, width=32),
    repetition_penalty=st.floats(-1, 3, width=32),
    logit_bias=st.dictionaries(st.integers(-3, 60000), st.floats(-200, 200, width=32), max_size=2),
)
GRPC_REQUESTS = st.one_of(
    st.builds(generate_pb2.GenerateRequest, text=TEXTS, sampling=SAMPLING, cache_salt=TEXTS),
    st.builds(
        generate_pb2.GenerateRequest,
        token_ids=st.builds(
            generate_pb2.TokenIds, ids=st.lists(st.integers(-3, 60000), max_size=6)
        ),
        sampling=SAMPLING,
    ),
    st.builds(generate_pb2.GenerateRequest, sampling=SAMPLING),
)


def test_random_grpc_requests_get_ok_or_invalid_argument(cluster):
    stub = generation_stub(cluster.ready["router"])
    metadata = (("authorization", f"Bearer {KEY}"),)
    count = [0]

    @settings(
        max_examples=NUM_GRPC,
        deadline=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
        database=None,
    )
    @given(GRPC_REQUESTS)
    def one(request):
        count[0] += 1
        try:
            messages = list(stub.Generate(request, timeout=60, metadata=metadata))
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, (
                exc.code(),
                exc.details(),
                request,
            )
            assert exc.details().split(":")[0], exc.details()
            return
        assert messages and messages[-1].finish_reason

    one()
    assert count[0] == NUM_GRPC
    _assert_clean(cluster)


def _assert_clean(cluster) -> None:
    """A normal request is answered; no block is leaked or pinned, nothing runs or waits."""
    stub = generation_stub(cluster.ready["router"])
    metadata = (("authorization", f"Bearer {KEY}"),)
    request = generate_pb2.GenerateRequest(
        text="The capital of France is", sampling=common_pb2.SamplingParams(max_tokens=4)
    )
    assert list(stub.Generate(request, timeout=60, metadata=metadata))[-1].finish_reason
    deadline = time.monotonic() + 10
    while True:
        infos = [
            worker_info(s["grpc"], s["role"])
            for s in cluster.ready["services"]
            if s["role"] != "router"
        ]
        clean = all(
            i.num_pinned_blocks == 0
            and i.num_running == 0
            and i.num_waiting == 0
            and i.num_free_blocks == i.num_blocks
            for i in infos
        )
        if clean or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert clean, infos
