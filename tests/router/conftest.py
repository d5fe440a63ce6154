"""Router test fixtures: the default model's info and tokenizer, and a router on loopback in
front of one fake prefill and one fake decode worker (see fakes.py)."""

from __future__ import annotations

import grpc
import pytest

from services.common.grpc_server import start_service
from services.common.pb import generate_pb2_grpc, worker_pb2_grpc
from services.config.roles import RouterConfig
from services.router.flow.prompt import ModelInfo
from services.router.server import start_router
from tests.router.fakes import FakeDecode, FakePrefill


@pytest.fixture(scope="session")
def model_info() -> ModelInfo:
    return ModelInfo.load("smollm2-135m-instruct")


@pytest.fixture(scope="session")
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
    config = RouterConfig(
        model=str(model_info.path),
        host="127.0.0.1",
        port=0,
        metrics_port=0,
        prefill=(prefill_service.grpc_address,),
        decode=(decode_service.grpc_address,),
        request_timeout=30.0,
        http_port=0,
        disaggregation="always",  # the fake workers script the remote path
    )
    router = start_router(config)
    yield router, prefill, decode
    router.stop(0)
    prefill_service.server.stop(0).wait()
    decode_service.server.stop(0).wait()


@pytest.fixture
def stub(cluster):
    channel = grpc.insecure_channel(cluster[0].service.grpc_address)
    yield generate_pb2_grpc.GenerationStub(channel)
    channel.close()
