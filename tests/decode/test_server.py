"""A whole cluster in this process, each service started from its config object: the router's
Generate answers with the tokens a BOTH engine computes alone."""

from __future__ import annotations

import grpc

from services.common.pb import common_pb2, generate_pb2, generate_pb2_grpc, worker_pb2_grpc
from services.config.roles import DecodeConfig, PrefillConfig, RouterConfig
from services.decode.server import start_decode
from services.engine import LLM, EngineConfig, SamplingParams
from services.prefill.server import start_prefill
from services.router.server import start_router
from tests.common.test_grpc_server import SERVING, health_status


def test_services_started_from_configs_serve_generate(tiny_llama):
    engine = EngineConfig(model=tiny_llama, num_blocks=64, block_size=4)
    prefill = start_prefill(PrefillConfig(engine=engine))
    decode = start_decode(DecodeConfig(engine=engine))
    router = start_router(
        RouterConfig(
            model=tiny_llama,
            port=0,
            prefill=(prefill.service.grpc_address,),
            decode=(decode.service.grpc_address,),
        )
    )
    try:
        prompt = list(range(5, 25))
        request = generate_pb2.GenerateRequest(
            token_ids=generate_pb2.TokenIds(ids=prompt),
            sampling={"max_tokens": 6, "temperature": 0.0, "ignore_eos": True},
        )
        with grpc.insecure_channel(router.service.grpc_address) as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            replies = list(stub.Generate(request, timeout=60))
        token_ids = [t for r in replies for t in r.token_ids]
        assert replies[-1].finish_reason == "length"
        [alone] = LLM(EngineConfig(model=tiny_llama)).generate(
            [prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        )
        assert token_ids == alone.token_ids
    finally:
        router.stop()
        decode.stop()
        prefill.stop()


def test_a_started_decode_worker_is_warm_serving_and_has_computed_nothing(tiny_llama):
    worker = start_decode(DecodeConfig(engine=EngineConfig(model=tiny_llama, num_blocks=32)))
    try:
        address = worker.service.grpc_address
        names = ("", "pdserve.v1.Decode", "pdserve.v1.Admin")
        assert [health_status(address, name) for name in names] == [SERVING] * len(names)
        with grpc.insecure_channel(address) as channel:
            stub = worker_pb2_grpc.AdminStub(channel)
            info = stub.GetInfo(common_pb2.InfoRequest(), timeout=10)
        assert info.num_prompt_tokens_computed == info.max_step_tokens_per_request == 0
        assert info.num_cached_blocks == info.num_running == info.num_waiting == 0
        assert info.num_free_blocks == info.num_blocks == 32
    finally:
        worker.stop()
