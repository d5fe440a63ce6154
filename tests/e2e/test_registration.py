"""Runtime membership outside Ray, through real processes: a router that starts with no workers
and workers started with `--register-with` join its pool, serve, leave on SIGTERM and lapse on
SIGKILL; a bad registration is refused with the field named."""

from __future__ import annotations

import signal
import time

import grpc
import pytest

from services.common.pb import common_pb2, generate_pb2, worker_pb2, worker_pb2_grpc
from tests.e2e.cluster import generate, generation_stub, start, start_all
from tests.reference import assert_equivalent, hf_greedy

pytestmark = pytest.mark.e2e
TTL_S = 2.0


def _workers(admin) -> list[tuple[str, str, bool]]:
    listed = admin.ListWorkers(common_pb2.InfoRequest(), timeout=10).workers
    return sorted((w.role, w.address, w.healthy) for w in listed)


def _until(predicate, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError("condition not met in time")


def test_workers_that_register_join_serve_leave_and_lapse(default_model, real_text_ids):
    router = start(
        "router",
        "--disaggregation",
        "always",
        "--port",
        "0",
        "--registration-ttl",
        str(TTL_S),
    )
    address = router.ready["grpc"]
    admin = worker_pb2_grpc.AdminStub(grpc.insecure_channel(address))
    procs = [router]
    try:
        assert _workers(admin) == []
        prefill, decode = start_all(
            ["prefill", "--port", "0", "--register-with", address],
            ["decode", "--port", "0", "--register-with", address],
        )
        procs += [prefill, decode]
        expected = [
            ("decode", decode.ready["grpc"], True),
            ("prefill", prefill.ready["grpc"], True),
        ]
        assert _workers(admin) == expected  # registered before their ready line
        prompt = real_text_ids[4000:4020]
        tokens, _, finish = generate(
            generation_stub(address),
            token_ids=generate_pb2.TokenIds(ids=prompt),
            sampling=common_pb2.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
        )
        assert finish == "length"
        assert_equivalent(tokens, hf_greedy(default_model, prompt, 12), "registered workers")

        assert decode.stop(signal.SIGTERM) == 0  # a clean stop leaves at once
        assert _workers(admin) == [("prefill", prefill.ready["grpc"], True)]
        started = time.monotonic()
        prefill.stop(signal.SIGKILL)  # a crash: out of routing now, out of the pool at the ttl
        _until(lambda: _workers(admin) == [])
        assert time.monotonic() - started < TTL_S + 2.0

        later = start("decode", "--port", "0", "--register-with", address)
        procs.append(later)
        assert _workers(admin) == [("decode", later.ready["grpc"], True)]
    finally:
        for proc in reversed(procs):
            proc.stop(signal.SIGKILL)


def test_a_bad_registration_names_its_field_and_a_worker_is_no_router(tiny_llama):
    router = start("router", "--model", tiny_llama, "--port", "0")
    worker = start("decode", "--model", tiny_llama, "--port", "0")
    try:
        for target, request, field in (
            (
                router,
                worker_pb2.RegisterWorkerRequest(role="router", address="127.0.0.1:9"),
                "role",
            ),
            (router, worker_pb2.RegisterWorkerRequest(role="decode", address="nowhere"), "address"),
            (
                worker,
                worker_pb2.RegisterWorkerRequest(role="decode", address="127.0.0.1:9"),
                "register_with",
            ),
        ):
            admin = worker_pb2_grpc.AdminStub(grpc.insecure_channel(target.ready["grpc"]))
            with pytest.raises(grpc.RpcError) as error:
                admin.RegisterWorker(request, timeout=10)
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert error.value.details().startswith(f"{field}:"), error.value.details()
    finally:
        router.stop(signal.SIGKILL)
        worker.stop(signal.SIGKILL)
