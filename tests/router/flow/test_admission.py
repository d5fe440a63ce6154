"""The admission gate (services/router/flow/admission.py) and the configs' API-key plumbing."""

from __future__ import annotations

import dataclasses
import threading
import time

import grpc
import pytest

from services.cluster.config import ClusterConfig
from services.cluster.launcher import cluster_spec
from services.common.pb import generate_pb2
from services.config.roles import RouterConfig, with_env_api_key
from services.engine.errors import InvalidRequestError
from services.router.flow.admission import AdmissionGate, OverloadedError
from services.router.server import warn_if_open
from tests.router.fakes import PROMPT, _completion_ids, _post, _script, _wait_until


def test_the_gate_admits_up_to_capacity_plus_queue_and_refuses_at_once():
    capacity = [3]
    gate = AdmissionGate(lambda: capacity[0], max_queued=2)
    tickets = [gate.admit() for _ in range(4)]
    with pytest.raises(OverloadedError, match="queue is full") as info:
        gate.admit(2)  # all or nothing: 4 + 2 > 5
    assert info.value.retry_after_s == 1
    tickets.append(gate.admit())
    with pytest.raises(OverloadedError):
        gate.admit()
    tickets[0].release()
    tickets[0].release()  # idempotent
    assert gate.in_flight == 4
    capacity[0] = 10  # a decode worker joined: more room at once
    big = gate.admit(8)
    assert gate.in_flight == 12
    big.release()
    for ticket in tickets:
        ticket.release()
    assert gate.in_flight == 0


def test_a_request_that_could_never_be_admitted_is_a_400_not_a_429():
    healthy = [2]
    gate = AdmissionGate(lambda: healthy[0], max_queued=1, ceiling=lambda: 4)
    with pytest.raises(InvalidRequestError, match="^n: 6 sequences .* can never be admitted"):
        gate.admit(6)  # more than 4 + 1 even with every worker healthy
    with pytest.raises(OverloadedError):
        gate.admit(4)  # fits once the unhealthy workers are back: retry later
    assert gate.in_flight == 0


def test_the_gate_never_over_admits_under_concurrency():
    gate = AdmissionGate(lambda: 5, max_queued=5)
    admitted, refused, lock = [], [0], threading.Lock()
    barrier = threading.Barrier(40)

    def one() -> None:
        barrier.wait()
        try:
            ticket = gate.admit()
        except OverloadedError:
            with lock:
                refused[0] += 1
            return
        with lock:
            admitted.append(ticket)

    threads = [threading.Thread(target=one) for _ in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(admitted) == 10 and refused[0] == 30 and gate.in_flight == 10


def test_the_api_key_comes_from_the_environment_and_never_from_argv():
    assert with_env_api_key(RouterConfig(), {"PDSERVE_API_KEY": "k"}).api_key == "k"
    assert (
        with_env_api_key(RouterConfig(api_key="mine"), {"PDSERVE_API_KEY": "k"}).api_key == "mine"
    )
    assert with_env_api_key(RouterConfig(), {}).api_key is None
    assert "secret" not in repr(RouterConfig(api_key="secret"))
    with pytest.raises(ValueError, match="^api_key: "):
        RouterConfig(api_key="")
    config = ClusterConfig(router=dataclasses.replace(ClusterConfig().router, api_key="secret"))
    router = cluster_spec(config).router(["127.0.0.1:1"], ["127.0.0.1:2"])
    assert not any("secret" in arg for arg in router.argv)
    assert router.env == {"PDSERVE_API_KEY": "secret"}


def test_binding_beyond_loopback_without_a_key_warns(caplog):
    assert warn_if_open(RouterConfig(host="0.0.0.0"))
    assert "without an API key" in caplog.text
    assert not warn_if_open(RouterConfig(host="0.0.0.0", api_key="k"))
    assert not warn_if_open(RouterConfig())


def test_a_full_router_refuses_grpc_and_http_at_once(cluster, tokenizer, stub, monkeypatch):
    """One sequence may be in flight: a second gets RESOURCE_EXHAUSTED (retry-after in the
    trailing metadata) / 429 with Retry-After, without waiting for the first."""
    router = cluster[0]
    monkeypatch.setattr(router.flow.admission, "_capacity", lambda: 1)
    monkeypatch.setattr(router.flow.admission, "max_queued", 0)
    ids = _completion_ids(tokenizer)
    _script(cluster, ids, endless_token=ids[1])
    running = stub.Generate(generate_pb2.GenerateRequest(text=PROMPT), timeout=30)
    next(running)
    assert _wait_until(lambda: router.flow.admission.in_flight == 1)
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(generate_pb2.GenerateRequest(text=PROMPT), timeout=30))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert ("retry-after", "1") in tuple(info.value.trailing_metadata())
    status, _ = _post(router.http.url + "/v1/completions", {"prompt": PROMPT})
    assert status == 429 and time.monotonic() - start < 2.0
    running.cancel()
    assert _wait_until(lambda: router.flow.admission.in_flight == 0)
