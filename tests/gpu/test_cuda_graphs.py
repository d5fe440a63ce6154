"""CUDA-graph decode equals eager decode: the engine really replays graphs (5 requests run in
the graph of 8, three padding rows), and its greedy output matches --enforce-eager's by the bf16
rule; the padded static batch replayed from its graph gives the logits of the same batch run
eagerly."""

from __future__ import annotations

import torch

from tests.gpu.models import GPU, assert_close_bf16, engine_greedy, engine_llm, small_llama

pytestmark = GPU


def test_cuda_graph_decode_equals_eager() -> None:
    path = small_llama()
    graphed_llm = engine_llm(path, attention_backend="triton", max_cuda_graph_batch_size=8)
    graphs = graphed_llm.engine.runner.graphs
    assert graphs is not None and graphs.graphs, "no decode graph was captured"
    assert graphs.padded_size(5) == 8
    replays = {"n": 0}
    replay = graphs.graphs[8].replay

    def counted() -> None:
        replays["n"] += 1
        replay()

    graphs.graphs[8].replay = counted
    graphed = engine_greedy(graphed_llm)
    assert replays["n"] > 0, "the batch of 5 never ran in its graph"
    eager_llm = engine_llm(path, attention_backend="triton", enforce_eager=True)
    assert eager_llm.engine.runner.graphs is None
    eager = engine_greedy(eager_llm)
    for i, (g, e) in enumerate(zip(graphed, eager, strict=True)):
        assert_close_bf16(g, e, f"graph vs eager, prompt {i}")
    print(f"  graph of 8 replayed {replays['n']} times")


def test_graph_replay_gives_the_eager_logits_of_its_batch() -> None:
    from services.engine.cuda_graphs import DecodeGraphs

    llm = engine_llm(small_llama(), attention_backend="triton", enforce_eager=True)
    engine = llm.engine
    cache, model = engine.kv_cache, engine.model
    cache.kv.normal_()  # any finite context: both runs read the same cache
    tables = [[3, 9, 4], [7], [12, 13], [0, 1, 2, 5, 6]]
    positions = [40, 2, 20, 70]
    tokens = [11, 12, 13, 14]
    graphed = DecodeGraphs(model, cache, (4, 8), 1024)  # 4 rows in the graph of 4
    want = graphed.run(tokens, positions, tables).clone()
    eager = DecodeGraphs(model, cache, (4, 8), 1024, capture=False)
    got = eager.run(tokens, positions, tables)
    diff = float((want - got).abs().max())
    print(f"  replay vs eager logits: max |diff| {diff:.3g}, bitwise {torch.equal(want, got)}")
    assert diff <= 0.05 * float(want.abs().max()), diff
