"""Role configs end to end: `pdserve serve` hands every child its config, and each child reports
the config it runs with (GetInfo); a non-default value in every field shows nothing is dropped on
the way (JSON, CLI, the children's own parsing)."""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from typing import Any

import grpc
import pytest

from services.cluster.config import ClusterConfig
from services.common.pb import common_pb2, generate_pb2, worker_pb2_grpc
from services.config.handoff import from_json, to_dict, to_json
from services.config.http import HttpConfig
from services.config.migration import MigrationConfig
from services.config.roles import DecodeConfig, PrefillConfig, PrefixIndexConfig, RouterConfig
from services.engine.config import EngineConfig, EngineRole
from tests.e2e.cluster import free_port, generation_stub, start

pytestmark = pytest.mark.e2e
KEY = "sk-config"
METADATA = (("authorization", f"Bearer {KEY}"),)

# Fields a cluster sets per child whatever it was given (so a value given there cannot reach a
# child), and `device`, whose only other value needs a GPU.
DERIVED = {
    "engine.device",
    "engine.engine_id",
    "router.model",
    "router.max_model_len",
    "router.prefill",
    "router.decode",
    "router.index",
    "router.cpus",
    *(
        f"{pool}.{name}"
        for pool in ("prefill", "decode")
        for name in (
            "engine",
            "host",
            "port",
            "metrics_port",
            "register_with",
            "kv_transfer_backend",
            "core_ledger",
            "index",
        )
    ),
}


TARGETS = os.path.join(tempfile.gettempdir(), f"pdserve-test-targets-{os.getpid()}.json")
STEP_LOG = os.path.join(tempfile.gettempdir(), f"pdserve-test-steps-{os.getpid()}")


def _port(address: str) -> int:
    return int(address.rpartition(":")[2])


def _non_default_cluster(model: str, redis_url: str) -> ClusterConfig:
    engine = EngineConfig(
        model=model,
        role=EngineRole.DECODE,
        dtype="bfloat16",
        block_size=8,
        kv_cache_memory_bytes=1 << 20,
        num_blocks=96,
        max_model_len=256,
        max_num_seqs=8,
        max_num_batched_tokens=128,
        slo_itl_ms=80.0,
        slo_tpot_ms=60.0,
        seed=7,
        shuffle_free_blocks=True,
        enable_prefix_caching=False,
        enable_kv_events=True,
        attention_backend="torch_sdpa",
        kv_transfer_timeout_s=20.0,
        max_num_waiting_for_kv=4,
        kv_lease_seconds=20.0,
        debug_recompute_prompt=True,
        gpu_memory_utilization=0.5,  # the CUDA-only fields travel on the CPU too
        enforce_eager=True,
        max_cuda_graph_batch_size=16,
    )
    router = RouterConfig(
        host="localhost",
        port=free_port(),
        metrics_port=free_port(),
        http_port=0,
        request_timeout=100.0,
        routing="round_robin",
        max_queued_requests=5,
        max_n=4,
        disaggregation="always",
        max_local_prefill_tokens=32,
        slo_ttft_ms=750.0,
        api_key=KEY,
        registration_ttl=7.0,
        max_concurrent_rpcs=500,
        migration=MigrationConfig(max_migrations=2, stream_stall_timeout=6.0, migration_wait=9.0),
        http=HttpConfig(
            max_body_bytes=100_000, read_timeout=20.0, keep_alive_timeout=3.0, shutdown_timeout=4.0
        ),
    )
    return ClusterConfig(
        engine=engine,
        router=router,
        index=PrefixIndexConfig(redis_url=redis_url, index_ttl=5.0),
        prefill=PrefillConfig(
            threads=1,
            cpus="0",
            drain_timeout=5.0,
            debug_kv_stall_seconds=0.01,
            max_concurrent_rpcs=300,
            step_log=STEP_LOG + ".prefill",
        ),
        decode=DecodeConfig(
            threads=1,
            cpus="1",
            drain_timeout=6.0,
            debug_zero_kv_block=0,
            debug_recompute_prompt=True,
            max_concurrent_rpcs=200,
            step_log=STEP_LOG + ".decode",
            cost_model="off",
        ),
        worker_host="localhost",
        kv_transfer_backend="grpc",
        num_prefill=2,
        num_decode=2,
        start_timeout=110.0,
        placement="none",
        core_lending=False,
        prometheus_targets=TARGETS,
    )


def _leaves(config: Any, prefix: str = "") -> dict[str, Any]:
    """{"engine.block_size": 8, ...}: every field of a config tree, dotted."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        value, name = getattr(config, f.name), prefix + f.name
        if dataclasses.is_dataclass(value) and name not in DERIVED:
            out.update(_leaves(value, name + "."))
        else:
            out[name] = value
    return out


def test_the_test_config_sets_every_field_to_a_non_default_value(tiny_llama):
    given, default = (
        _leaves(_non_default_cluster(tiny_llama, "redis://h:1/0")),
        _leaves(ClusterConfig()),
    )
    same = sorted(name for name in given if name not in DERIVED and given[name] == default[name])
    assert same == [], f"give these fields a non-default value in this test: {same}"


def _info(address: str) -> common_pb2.WorkerInfo:
    with grpc.insecure_channel(address) as channel:
        return worker_pb2_grpc.AdminStub(channel).GetInfo(
            common_pb2.InfoRequest(), timeout=30, metadata=METADATA
        )


def test_every_child_reports_the_config_its_parent_gave_it(tiny_llama, redis_server):
    cluster = _non_default_cluster(tiny_llama, redis_server.url)
    proc = start("serve", "--config-json", to_json(cluster))
    try:
        ready = proc.ready
        services = ready["services"]
        assert [s["role"] for s in services] == ["router", "prefill", "prefill", "decode", "decode"]
        infos = {s["grpc"]: _info(s["grpc"]) for s in services}
        # The router: the cluster's router settings, the engine's model and limits, the index,
        # and the workers' addresses from their ready lines.
        router = from_json(RouterConfig, infos[ready["router"]].config_json)
        addresses = {
            role: [s["grpc"] for s in services if s["role"] == role]
            for role in ("prefill", "decode")
        }
        given = cluster.router_config(addresses["prefill"], addresses["decode"])
        # effective: what it was given, with the HTTP port it bound (0 asked for a free one)
        http_port = int(ready["http"].rpartition(":")[2])
        # (and the key redacted: it reached the router through the environment)
        assert router == dataclasses.replace(given, http_port=http_port, api_key="<redacted>")
        assert ready["router"] == f"localhost:{cluster.router.port}"
        engine_ids = set()
        for service in services[1:]:
            info = infos[service["grpc"]]
            config_cls = PrefillConfig if service["role"] == "prefill" else DecodeConfig
            got = from_json(config_cls, info.config_json)
            given = getattr(cluster, f"{service['role']}_config")(0)
            given = dataclasses.replace(
                given, engine=dataclasses.replace(given.engine, engine_id=info.engine_id)
            )
            # effective: the engine in the worker's role, and the ports it bound (0: free ones)
            expected = dataclasses.replace(
                given,
                engine=given.engine_config(),
                port=_port(service["grpc"]),
                metrics_port=_port(service["metrics"].removesuffix("/metrics")),
            )
            assert to_dict(got) == to_dict(expected)
            assert info.role == service["role"] and info.engine_id.startswith(service["role"])
            # ... and runs it: the engine's own figures follow the config.
            assert (info.num_blocks, info.kv_layout.block_size, info.kv_layout.dtype) == (
                96,
                8,
                "bfloat16",
            )
            assert info.max_model_len == 256
            engine_ids.add(info.engine_id)
        assert len(engine_ids) == 4
        request = generate_pb2.GenerateRequest(
            token_ids={"ids": [5, 6, 7, 8]},
            sampling={"max_tokens": 4, "temperature": 0.0, "ignore_eos": True},
        )
        stub = generation_stub(ready["router"])
        replies = list(stub.Generate(request, timeout=60, metadata=METADATA))
        assert sum(len(r.token_ids) for r in replies) == 4
        assert replies[-1].finish_reason == "length"
        json.dumps(ready)  # the ready line stays plain JSON
        # --prometheus-targets: one file_sd group per service, named as the ready line names it
        with open(TARGETS) as f:
            groups = json.load(f)
        assert [g["labels"]["service"] for g in groups] == [s["name"] for s in services]
        assert [g["labels"]["worker"] for g in groups] == [s["grpc"] for s in services]
        assert {g["labels"]["model"] for g in groups} == {os.path.basename(tiny_llama)}
    finally:
        assert proc.stop() == 0
    with open(TARGETS) as f:
        assert json.load(f) == []  # emptied at exit: Prometheus drops the targets
    os.remove(TARGETS)
