"""The prefill worker started in-process from its config: warm-up before health says SERVING,
Prefill, GetInfo, ReleaseKV."""

from __future__ import annotations

import dataclasses
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from services.common.grpc_server import start_service
from services.common.pb import common_pb2, worker_pb2, worker_pb2_grpc
from services.config.handoff import from_json
from services.config.roles import PrefillConfig
from services.engine import EngineConfig
from services.engine.engine import Engine
from services.prefill.server import start_prefill
from services.worker.cpus import format_cpus
from tests.common.test_grpc_server import NOT_SERVING, SERVING, health_status
from tests.e2e.cluster import free_port

SERVICES = ("", "pdserve.v1.Prefill", "pdserve.v1.KVTransfer", "pdserve.v1.Admin")


@pytest.fixture
def prefill(tiny_llama):
    config = PrefillConfig(
        engine=EngineConfig(model=tiny_llama, num_blocks=64, block_size=4, kv_lease_seconds=7.0),
        drain_timeout=1.0,
    )
    worker = start_prefill(config)
    yield worker, config
    worker.stop()


def test_prefill_pins_the_prompt_kv_and_reports_its_config(prefill):
    worker, config = prefill
    with grpc.insecure_channel(worker.service.grpc_address) as channel:
        info = worker_pb2_grpc.AdminStub(channel).GetInfo(common_pb2.InfoRequest(), timeout=10)
        effective = from_json(PrefillConfig, info.config_json)
        assert info.role == "prefill" and effective.engine.role.value == "prefill"
        assert f"127.0.0.1:{effective.port}" == worker.service.grpc_address
        assert effective.metrics_port != 0
        # the engine as it runs: the worker's role, max_model_len resolved from the model
        assert effective.engine == dataclasses.replace(config.engine_config(), max_model_len=1024)
        # ... and the threads and CPUs it runs on (this process's: the worker is in-process)
        assert (effective.threads, effective.cpus) == (
            torch.get_num_threads(),
            format_cpus(sorted(os.sched_getaffinity(0))),
        )
        assert (
            dataclasses.replace(
                effective, engine=config.engine, port=0, metrics_port=0, threads=None, cpus=None
            )
            == config
        )
        reply = worker_pb2_grpc.PrefillStub(channel).Prefill(
            worker_pb2.PrefillRequest(
                request_id="r",
                prompt_token_ids=list(range(3, 13)),
                sampling=common_pb2.SamplingParams(max_tokens=4, temperature=0.0),
            ),
            timeout=30,
        )
        assert reply.kv_handle.num_tokens == 10 and len(reply.kv_handle.block_ids) == 3
        assert reply.kv_handle.source == worker.service.grpc_address
        info = worker_pb2_grpc.PrefillStub(channel).GetInfo(common_pb2.InfoRequest(), timeout=10)
        assert info.num_pinned_blocks == 3
        released = worker_pb2_grpc.KVTransferStub(channel).ReleaseKV(
            worker_pb2.ReleaseKVRequest(request_id="r"), timeout=10
        )
        assert released.released
        info = worker_pb2_grpc.PrefillStub(channel).GetInfo(common_pb2.InfoRequest(), timeout=10)
        assert info.num_pinned_blocks == 0 and info.num_free_blocks == info.num_blocks == 64


def test_a_started_worker_is_warm_serving_and_has_computed_nothing(prefill):
    worker, _ = prefill
    address = worker.service.grpc_address
    assert [health_status(address, name) for name in SERVICES] == [SERVING] * len(SERVICES)
    with grpc.insecure_channel(address) as channel:
        info = worker_pb2_grpc.AdminStub(channel).GetInfo(common_pb2.InfoRequest(), timeout=10)
    # The warm-up's forwards went around the scheduler and the engine loop's step counters.
    assert info.num_prompt_tokens_computed == info.max_step_tokens_per_request == 0
    assert info.num_cached_blocks == info.num_pinned_blocks == 0
    assert info.num_running == info.num_waiting == 0
    assert info.num_free_blocks == info.num_blocks == 64


def _config(model: str, port: int) -> PrefillConfig:
    return PrefillConfig(engine=EngineConfig(model=model, num_blocks=64, block_size=4), port=port)


def test_health_is_not_serving_while_the_engine_warms_up(tiny_llama, monkeypatch):
    entered, release, threads = threading.Event(), threading.Event(), []
    real_warm_up = Engine.warm_up

    def blocking_warm_up(engine: Engine) -> float:
        threads.append(threading.current_thread().name)
        entered.set()
        assert release.wait(60)
        return real_warm_up(engine)

    monkeypatch.setattr(Engine, "warm_up", blocking_warm_up)
    port = free_port()
    address = f"127.0.0.1:{port}"
    with ThreadPoolExecutor(1) as pool:
        starting = pool.submit(start_prefill, _config(tiny_llama, port))
        try:
            assert entered.wait(60)  # the server listens; the engine thread is inside warm_up
            statuses = [health_status(address, name) for name in SERVICES]
            assert statuses == [NOT_SERVING] * len(SERVICES) and not starting.done()
        finally:
            release.set()
        worker = starting.result(timeout=60)
    try:
        assert threads == ["prefill-engine"]  # the thread that will serve is the one warmed
        assert [health_status(address, name) for name in SERVICES] == [SERVING] * len(SERVICES)
    finally:
        worker.stop()


def test_a_failed_warm_up_stops_the_worker(tiny_llama, monkeypatch):
    def failing_warm_up(engine: Engine) -> float:
        raise RuntimeError("warm-up broke")

    monkeypatch.setattr(Engine, "warm_up", failing_warm_up)
    port = free_port()
    with pytest.raises(RuntimeError, match="warm-up broke"):
        start_prefill(_config(tiny_llama, port))
    service = start_service("prefill", [], "127.0.0.1", port, 0)  # nothing was left listening
    service.server.stop(0)
