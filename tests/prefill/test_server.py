"""The prefill worker started in-process from its config: Prefill, GetInfo, ReleaseKV."""

from __future__ import annotations

import dataclasses

import grpc
import pytest

from services.common.config import PrefillConfig
from services.common.config_json import from_json
from services.common.pb import common_pb2, worker_pb2, worker_pb2_grpc
from services.engine import EngineConfig
from services.prefill.server import start_prefill


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
        assert (
            dataclasses.replace(effective, engine=config.engine, port=0, metrics_port=0) == config
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
