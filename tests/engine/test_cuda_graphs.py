"""The CUDA-graph decode path's logic on the CPU: the captured sizes, and the padded static
batch (run eagerly, `capture=False`, through the Triton kernel in Triton's interpreter) giving
the reference's greedy tokens. Capture and replay themselves need a GPU (tests/gpu)."""

from __future__ import annotations

import pytest

from services.engine import EngineConfig, SamplingParams
from services.engine.cuda_graphs import DecodeGraphs, capture_sizes, decode_graphs
from tests.reference import assert_equivalent, hf_greedy

pytest.importorskip("triton")


def test_capture_sizes_cover_every_batch_up_to_the_cap():
    assert capture_sizes(256, 256)[:6] == (1, 2, 4, 8, 16, 24)
    assert capture_sizes(256, 256)[-1] == 256
    assert capture_sizes(256, 20) == (1, 2, 4, 8, 16, 20)  # max_num_seqs caps, and is captured
    assert capture_sizes(3, 256) == (1, 2, 3)


def test_no_graphs_off_cuda_or_when_eager(tiny_llama):
    from services.engine.llm import LLM

    llm = LLM(EngineConfig(model=tiny_llama, attention_backend="triton", num_blocks=16))
    assert llm.engine.runner.graphs is None  # the CPU never captures
    assert decode_graphs(llm.engine.config, llm.engine.model, llm.engine.kv_cache) is None


def test_padded_static_decode_batches_give_the_reference_tokens(tiny_llama):
    from services.engine.llm import LLM

    config = EngineConfig(
        model=tiny_llama, attention_backend="triton", block_size=16, num_blocks=64
    )
    llm = LLM(config)
    engine = llm.engine
    graphs = DecodeGraphs(engine.model, engine.kv_cache, (1, 2, 4, 8), 1024, capture=False)
    engine.runner.graphs = graphs  # decode steps now go through the padded static buffers
    calls = []
    run = graphs.run
    graphs.run = lambda *a: calls.append(len(a[0])) or run(*a)  # type: ignore[method-assign]
    prompts = [list(range(3 + i, 20 + 3 * i)) for i in range(5)]  # 5 requests: padded to 8
    outputs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert calls and max(calls) == 5 and 3 not in {graphs.padded_size(n) for n in calls}
    for prompt, out in zip(prompts, outputs, strict=True):
        assert_equivalent(out.token_ids, hf_greedy(tiny_llama, prompt, 6), context="padded")
    engine.check_integrity()
